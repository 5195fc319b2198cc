"""The pipeline schedule's time: the bubble shrinks with interleaving, the waited transfers grow."""

import pytest

import megafab.plan.schedule as schedule
from megafab.distributed.schedule_table import schedule_table
from megafab.plan.schedule import StagePass, pipeline_time, shared_pipeline_time


def test_one_f_one_b_waits_a_transfer_each_way_per_micro_batch_and_the_fill():
    t = pipeline_time([1.0, 1.5], micro_batches=8, vpp=1, p2p_seconds=0.01)
    assert (t.compute, t.bubble) == (12.0, 1.0)
    assert t.p2p == pytest.approx(2 * (8 + 1) * 0.01)


def test_interleaving_divides_the_bubble_and_multiplies_the_transfers_by_the_chunks():
    t = pipeline_time([1.0, 1.0, 1.0, 1.0], micro_batches=8, vpp=2, p2p_seconds=0.01)
    assert t.bubble == pytest.approx(3.0 / 2)
    assert t.p2p == pytest.approx(2 * (2 * 8 + 3) * 0.01)  # megafab's interleaved schedule waits for each


def test_one_stage_has_no_bubble_and_no_transfers():
    t = pipeline_time([2.0], micro_batches=4, vpp=1, p2p_seconds=0.01)
    assert (t.total, t.bubble, t.p2p) == (8.0, 0.0, 0.0)


def test_the_simulated_schedule_equals_the_closed_form_when_compute_is_never_shared():
    for stages, micro_batches, vpp in [(2, 8, 1), (4, 8, 1), (4, 2, 1), (4, 8, 2), (2, 4, 2), (4, 4, 4)]:
        simulated = shared_pipeline_time([StagePass(1.0, 0.0)] * stages, [StagePass(1.5, 0.5)] * stages,
                                         micro_batches, vpp, 0.01, slowdown=lambda busy: 1.0)
        closed = pipeline_time([3.0] * stages, micro_batches, vpp, 0.01)
        assert (simulated.compute, simulated.bubble, simulated.p2p) == pytest.approx(
            (closed.compute, closed.bubble, closed.p2p)), (stages, micro_batches, vpp)


def test_ranks_waiting_in_the_fill_and_drain_leave_their_cores_to_the_others():
    # forward 1 s, backward 2 s of compute alone; 2 cores: k busy ranks each run at min(1, 2 / k)
    forward, backward = StagePass(1.0, 0.0), StagePass(2.0, 0.0)
    # PP 2 x DP 2, two micro-batches: 2 ranks per stage. By hand: F1 alone 0-1; F2 on stage 0 and F1
    # on stage 1 shared 1-3; B1 on stage 1 alone 3-5; B1 on stage 0 and F2, B2 on stage 1 shared 5-9;
    # the rest of B2 on stage 1 alone 9-10; B2 on stage 0 alone 10-12. Every pass at half speed: 18.
    pp2 = shared_pipeline_time([forward] * 2, [backward] * 2, 2, 1, 0.0, lambda busy: max(1.0, busy))
    assert pp2.total == pytest.approx(12.0)
    # PP 4, two micro-batches: never more than two stages busy at once, so no pass is slowed:
    # (m + p - 1) x 3 s
    pp4 = shared_pipeline_time([forward] * 4, [backward] * 4, 2, 1, 0.0, lambda busy: max(1.0, busy / 2))
    assert pp4.total == pytest.approx(15.0)
    # collectives are not stretched: 1 s of each pass's 3 s is communication
    comm = shared_pipeline_time([StagePass(0.5, 0.5)] * 2, [StagePass(1.5, 0.5)] * 2, 8, 1, 0.0,
                                lambda busy: 2.0)
    assert comm.total == pytest.approx(9 * (2 * 2.0 + 1.0))


def test_the_simulation_runs_the_executors_order(monkeypatch):
    # stage 0 of 2, 4 micro-batches, 2 chunks: (p - 1) * 2 + (v - 1) * p = 4 warm-up forwards
    order = [(p.forward, p.microbatch, p.chunk) for p in schedule_table(0, 2, 4, 2)]
    assert order[:4] == [(True, 0, 0), (True, 1, 0), (True, 0, 1), (True, 1, 1)]
    assert order[4:6] == [(True, 2, 0), (False, 0, 1)]
    assert sorted(order) == sorted([(f, mb, c) for f in (True, False) for mb in range(4) for c in range(2)])
    # shared_pipeline_time reads megafab.distributed's table (the one the executors run), no copy
    asked = []

    def recording_table(*args):
        asked.append(args)
        return schedule_table(*args)

    monkeypatch.setattr(schedule, "schedule_table", recording_table)
    shared_pipeline_time([StagePass(1.0, 0.0)] * 2, [StagePass(2.0, 0.0)] * 2, 4, 2, 0.0, lambda busy: 1.0)
    assert asked == [(0, 2, 4, 2, None), (1, 2, 4, 2, None)]  # None: the default group of p


def test_the_simulation_takes_the_micro_batch_group_size(monkeypatch):
    """--microbatch-group-size-per-virtual-pipeline-stage reaches the simulated table: 5 micro-batches
    in groups of 3 (the default group of p = 2 cannot run them)."""
    asked = []

    def recording_table(*args):
        asked.append(args)
        return schedule_table(*args)

    monkeypatch.setattr(schedule, "schedule_table", recording_table)
    run = shared_pipeline_time([StagePass(1.0, 0.0)] * 2, [StagePass(2.0, 0.0)] * 2, 5, 2, 0.0,
                               lambda busy: 1.0, group_size=3)
    assert asked == [(0, 2, 5, 2, 3), (1, 2, 5, 2, 3)] and run.compute > 0
