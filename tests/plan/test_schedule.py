"""The pipeline schedule's time: the bubble shrinks with interleaving, the waited transfers grow."""

import pytest

from megafab.plan.schedule import pipeline_time


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
