"""Every mapping's forward and backward against the collective computed by hand.

Each rank regenerates every group member's input and upstream gradient from a seed, so it can
compute what the collective must return without communicating.
"""

import pytest
import torch
import torch.distributed as dist

from megafab.distributed import mappings as m
from megafab.run.fork_ranks import run_ranks

SHAPE = (8, 2, 12)  # [s, b, h], divisible by 2 and 4 along s and h


def _tensor(seed: int, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-10)


def _run_pair(fn, x, grad):
    """Forward fn on a leaf copy of x, backward with upstream grad; return (y, x.grad)."""
    leaf = x.clone().requires_grad_(True)
    y = fn(leaf)
    (y * grad).sum().backward()
    return y.detach(), leaf.grad


def _check_mappings(rank, world, tp):
    first = rank - rank % tp
    members = list(range(first, first + tp))
    groups = [dist.new_group(list(range(start, start + tp))) for start in range(0, world, tp)]
    group = groups[rank // tp]
    me = rank % tp
    xs = [_tensor(100 + r) for r in members]          # every member's input
    gs_full = [_tensor(200 + r) for r in members]     # upstream grads shaped like the input
    x, g_full = xs[me], gs_full[me]

    def chunk_last(t, i):
        return t.chunk(tp, dim=-1)[i]

    def chunk_first(t, i):
        return t.chunk(tp, dim=0)[i]

    # f: identity forward, all-reduce backward
    y, dx = _run_pair(lambda t: m.copy_to_tensor_model_parallel_region(t, group), x, g_full)
    _close(y, x)
    _close(dx, sum(gs_full))

    # g: all-reduce forward, identity backward
    y, dx = _run_pair(lambda t: m.reduce_from_tensor_model_parallel_region(t, group), x, g_full)
    _close(y, sum(xs))
    _close(dx, g_full)

    # scatter last dim: own chunk forward, all-gather of the ranks' chunk grads backward
    gs_part = [chunk_last(gr, i) for i, gr in enumerate(gs_full)]
    y, dx = _run_pair(lambda t: m.scatter_to_tensor_model_parallel_region(t, group), x, gs_part[me])
    _close(y, chunk_last(x, me))
    _close(dx, torch.cat(gs_part, dim=-1))

    # gather last dim: concat of every member's input forward, own chunk of the grad backward
    xs_part = [chunk_last(xr, 0) for xr in xs]
    y, dx = _run_pair(lambda t: m.gather_from_tensor_model_parallel_region(t, group), xs_part[me], g_full)
    _close(y, torch.cat(xs_part, dim=-1))
    _close(dx, chunk_last(g_full, me))

    # sequence scatter: own dim-0 chunk forward, all-gather dim 0 backward
    gs_seq = [chunk_first(gr, i) for i, gr in enumerate(gs_full)]
    y, dx = _run_pair(lambda t: m.scatter_to_sequence_parallel_region(t, group), x, gs_seq[me])
    _close(y, chunk_first(x, me))
    _close(dx, torch.cat(gs_seq, dim=0))

    # sequence gather: all-gather dim 0 forward; reduce-scatter (or split) backward
    xs_seq = [chunk_first(xr, 0) for xr in xs]
    y, dx = _run_pair(lambda t: m.gather_from_sequence_parallel_region(t, group), xs_seq[me], g_full)
    _close(y, torch.cat(xs_seq, dim=0))
    _close(dx, chunk_first(sum(gs_full), me))
    y, dx = _run_pair(lambda t: m.gather_from_sequence_parallel_region(
        t, group, tensor_parallel_output_grad=False), xs_seq[me], g_full)
    _close(y, torch.cat(xs_seq, dim=0))
    _close(dx, chunk_first(g_full, me))

    # g-bar: reduce-scatter dim 0 forward, all-gather dim 0 backward
    y, dx = _run_pair(lambda t: m.reduce_scatter_to_sequence_parallel_region(t, group), x, gs_seq[me])
    _close(y, chunk_first(sum(xs), me))
    _close(dx, torch.cat(gs_seq, dim=0))

    # the caller's tensors are never written
    _close(x, _tensor(100 + rank))

    # a length that does not split evenly is a user-facing error naming the sizes
    with pytest.raises(m.ShardingError, match="sequence length"):
        m.scatter_to_sequence_parallel_region(torch.zeros(tp + 1, 2, 4, dtype=torch.float64), group)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_equal_hand_computed_collectives(tp):
    # world 4: tp=2 also proves the functions use the given subgroup, not the world
    assert run_ranks(_check_mappings, 4, tp, timeout=90) == [True] * 4


def _check_bypass(rank, world):
    singletons = [dist.new_group([r]) for r in range(world)]
    x = _tensor(7).requires_grad_(True)
    fns = [m.copy_to_tensor_model_parallel_region, m.reduce_from_tensor_model_parallel_region,
           m.scatter_to_tensor_model_parallel_region, m.gather_from_tensor_model_parallel_region,
           m.scatter_to_sequence_parallel_region, m.gather_from_sequence_parallel_region,
           m.reduce_scatter_to_sequence_parallel_region]
    for fn in fns:
        for group in (None, singletons[rank]):
            assert fn(x, group) is x, fn.__name__
    return True


def test_one_rank_bypass_returns_input_unchanged():
    assert run_ranks(_check_bypass, 2, timeout=60) == [True, True]


def test_bypass_needs_no_process_group():
    x = _tensor(3)
    assert m.copy_to_tensor_model_parallel_region(x, None) is x
    assert m.group_size(None) == 1 and m.group_rank(None) == 0
