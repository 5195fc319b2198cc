"""The pipeline executors run schedule_table's order, and that order is megatron-core 0.16.1's.

One launch per pipeline size runs the real 1F1B and interleaved executors (gloo, forked ranks) over
every case of a grid on a recording model: each forward and backward logs (micro-batch, chunk),
and each checks that what it received is that micro-batch's tensor from the neighbouring virtual
stage (activations carry mb * 1000 + virtual stage, gradients (mb + 1) / m).
"""

from types import SimpleNamespace

import pytest
import torch

from megafab.distributed.pipeline import PipelineScheduleError, get_forward_backward_func
from megafab.distributed.schedule_table import (
    COOLDOWN,
    STEADY,
    WARMUP,
    interleaving_problem,
    num_warmup,
    schedule_table,
)
from megafab.distributed.topology import build_topology
from megafab.run.fork_ranks import run_ranks

VPPS = (1, 2, 3)
MICRO_BATCHES = range(4, 10)


def _cases(pp):
    """(vpp, m, group size or None, forward_only): the default group for every vpp and m, both
    ways; with vpp > 1 every other group size from pp to m, accepted or not."""
    out = [(vpp, m, None, fo) for vpp in VPPS for m in MICRO_BATCHES for fo in (False, True)]
    out += [(vpp, m, n, False) for vpp in VPPS[1:] for m in MICRO_BATCHES for n in range(pp + 1, m + 1)]
    return out + [(2, 5, pp - 1, False), (2, 5, 6, False)]  # group sizes out of [pp, m]


class _Tag(torch.autograd.Function):
    """Identity that logs its backward and checks the gradient it got."""

    @staticmethod
    def forward(ctx, x, mb, chunk, log, expected_grad):
        ctx.mb, ctx.chunk, ctx.log, ctx.expected_grad = mb, chunk, log, expected_grad
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("B", ctx.mb, ctx.chunk))
        assert torch.all((grad - ctx.expected_grad).abs() < 1e-12), (ctx.mb, ctx.chunk, grad.item())
        return grad, None, None, None, None


class _Chunk(torch.nn.Module):
    def __init__(self, chunk, virtual_stage, stages):
        super().__init__()
        self.chunk, self.virtual_stage = chunk, virtual_stage
        self.first, self.last = virtual_stage == 0, virtual_stage == stages - 1
        self.weight = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor


def _record(rank, world, cases):
    topo = build_topology(tp=1, pp=world)
    results = {}
    for vpp, m, group, forward_only in cases:
        log = []
        chunks = [_Chunk(c, c * world + rank, world * vpp) for c in range(vpp)]

        def forward_step(data_iterator, model, log=log, m=m):
            mb = next(data_iterator)
            log.append(("F", mb, model.chunk))
            if model.first:
                x = torch.full((1, 1, 1), mb * 1000.0, dtype=torch.float64)
            else:
                x = model.input_tensor
                assert torch.all(x == mb * 1000 + model.virtual_stage), (mb, model.chunk, x.item())
            out = _Tag.apply(x * model.weight + 1, mb, model.chunk, log, (mb + 1) / m)
            return out, lambda output: (output.sum() * (mb + 1), {})

        schedule = get_forward_backward_func(world, vpp)
        try:
            schedule(forward_step_func=forward_step, data_iterator=[iter(range(m)) for _ in chunks],
                     model=chunks if vpp > 1 else chunks[0], num_microbatches=m, seq_length=1,
                     micro_batch_size=1, hidden_size=1, topology=topo, dtype=torch.float64,
                     forward_only=forward_only, microbatch_group_size_per_vp_stage=group)
        except PipelineScheduleError as error:
            results[(vpp, m, group, forward_only)] = str(error)
            continue
        if not forward_only:
            assert all(c.weight.grad is not None for c in chunks)
        results[(vpp, m, group, forward_only)] = log
    return results


@pytest.mark.parametrize("pp", [2, 4])
def test_executors_run_the_table(pp):
    cases = _cases(pp)
    per_rank = run_ranks(_record, pp, cases, timeout=60)
    ran = refused = 0
    for vpp, m, group, forward_only in cases:
        problem = interleaving_problem(m, pp, group) if vpp > 1 else None
        for rank in range(pp):
            got = per_rank[rank][(vpp, m, group, forward_only)]
            if problem is not None:
                assert got == problem, (vpp, m, group, rank)
                continue
            want = [("F" if p.forward else "B", p.microbatch, p.chunk)
                    for p in schedule_table(rank, pp, m, vpp, group, forward_only)]
            assert got == want, (vpp, m, group, forward_only, rank)
        ran, refused = ran + (problem is None), refused + (problem is not None)
    assert ran >= 30 and refused >= 10


def test_interleaving_refusals_are_megatron_cores_rule():
    # groups of pp (the default): a remainder is always fewer than pp micro-batches
    assert interleaving_problem(6, 4).startswith("num_microbatches 6 is not divisible by "
                                                 "pipeline-model-parallel-size 4")
    assert interleaving_problem(8, 4) is None and interleaving_problem(4, 4) is None
    # groups of N in [pp, m]: the last group whole or at least pp micro-batches
    assert interleaving_problem(9, 4, 5) is None and interleaving_problem(5, 2, 3) is None
    assert "leaves a last group of 1" in interleaving_problem(9, 4, 4)
    assert "must lie between" in interleaving_problem(5, 2, 6)
    assert "must lie between" in interleaving_problem(5, 4, 3)


def _megatron_order(mcore, rank, pp, m, vpp, group, forward_only):
    """The order megatron-core's schedule loops walk: warmup forwards, (forward w+i, backward i),
    the remaining backwards; forward k is get_schedule_table's entry k, backward k its chunk
    reversed (1F1B: one chunk, micro-batches in order)."""
    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                           virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    total, _, warmup, _ = mcore.get_pp_rank_microbatches(m, vpp, group, forward_only=forward_only,
                                                         p2p_communicator=comm)
    table = mcore.get_schedule_table(m, vpp, group) if vpp > 1 else [(k, 0) for k in range(m)]
    forward = [("F", mb, c) for mb, c in table]
    backward = [("B", mb, vpp - 1 - c) for mb, c in table]
    if forward_only:  # the warmup loop runs every forward
        return forward
    order = forward[:warmup]
    for i in range(total - warmup):
        order += [forward[warmup + i], backward[i]]
    return order + backward[total - warmup:]


def test_the_table_is_megatron_cores_order():
    from megatron.core.pipeline_parallel import schedules as mcore

    checked = 0
    for pp in (2, 4):
        for vpp, m, group, forward_only in _cases(pp):
            if vpp > 1 and interleaving_problem(m, pp, group) is not None:
                continue
            for rank in range(pp):
                table = schedule_table(rank, pp, m, vpp, group, forward_only)
                mine = [("F" if p.forward else "B", p.microbatch, p.chunk) for p in table]
                assert mine == _megatron_order(mcore, rank, pp, m, vpp, group or pp, forward_only), (
                    pp, rank, m, vpp, group, forward_only)
                checked += 1
    assert checked > 200


def test_phases_are_megatrons_warmup_steady_cooldown():
    # stage 1 of 4, 8 micro-batches, 2 chunks: 2 * (4 - 1 - 1) + (2 - 1) * 4 = 8 warm-up forwards
    table = schedule_table(1, 4, 8, 2)
    assert num_warmup(1, 4, 8, 2) == 8
    assert [p.phase for p in table] == [WARMUP] * 8 + [STEADY] * 16 + [COOLDOWN] * 8
    assert [(p.forward, p.step) for p in table[8:12]] == [(True, 8), (False, 0), (True, 9), (False, 1)]
    # 1F1B: p - r - 1 warm-up forwards, all of them when there are fewer micro-batches
    assert num_warmup(0, 4, 8) == 3 and num_warmup(0, 4, 2) == 2 and num_warmup(3, 4, 8) == 0
    assert [p.forward for p in schedule_table(0, 4, 2)] == [True, True, False, False]
