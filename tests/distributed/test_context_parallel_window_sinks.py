"""Context-parallel attention with a sliding window and attention sinks against one process's
attention (float64, gloo): the output and the gradients of q, k, v and the sink, for every comm
type that takes them (a window: allgather and a2a; sinks: all three, on the fused CPU kernel and
the portable reference). p2p refuses a window (its ring blocks are causal or full)."""

import pytest
import torch
import torch.distributed as dist

from megafab.distributed.context_parallel import context_parallel_attention, split_for_context_parallel
from megafab.distributed.masked_attention import attention, bottom_right_positions, window_mask
from megafab.run.fork_ranks import run_ranks

TOL = 1e-10


def _parity(rank, world, comm, window, with_sink, implementation="auto"):
    torch.manual_seed(0)
    b, s, d, heads, groups = 2, 8 * world, 8, 8, 4
    q = torch.randn(b, heads, s, d, dtype=torch.float64)
    k = torch.randn(b, groups, s, d, dtype=torch.float64)
    v = torch.randn(b, groups, s, d, dtype=torch.float64)
    sink = torch.randn(heads, dtype=torch.float64) if with_sink else None
    dout = torch.randn(b, heads, s, d, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    sr = None if sink is None else sink.clone().requires_grad_()
    masked = window_mask(*bottom_right_positions(s, s), window)
    ref = attention(qr, kr, vr, masked, sr)
    ref.backward(dout)

    def local(t):
        return split_for_context_parallel(t, 2, rank, world)

    ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
    sl = None if sink is None else sink.clone().requires_grad_()
    out = context_parallel_attention(ql, kl, vl, dist.group.WORLD, comm, implementation=implementation,
                                     window=window, sink=sl)
    out.backward(local(dout))
    errors = [(out - local(ref)).abs().max().item()]
    for mine, full in ((ql, qr), (kl, kr), (vl, vr)):
        errors.append((mine.grad - local(full.grad)).abs().max().item())
    if sl is not None:  # each CP rank holds its queries' share of the sink's gradient
        dist.all_reduce(sl.grad)
        errors.append((sl.grad - sr.grad).abs().max().item())
    # the window and the sink are in effect
    plain = attention(q, k, v, None, None)
    errors.append(-(plain - ref.detach()).abs().max().item() + 1e-3)
    return errors


@pytest.mark.parametrize("comm,window,sink", [("allgather", 5, False), ("allgather", 3, True),
                                              ("a2a", 5, True), ("a2a", 2, False), ("p2p", None, True),
                                              ("allgather", None, True), ("a2a", None, True)])
def test_window_and_sinks_equal_one_process(comm, window, sink):
    for errors in run_ranks(_parity, 2, comm, window, sink, timeout=60):
        assert max(errors) < TOL, errors


@pytest.mark.parametrize("comm", ["p2p", "allgather"])
def test_sinks_on_the_portable_reference_kernel(comm):
    for errors in run_ranks(_parity, 2, comm, None, True, "reference", timeout=60):
        assert max(errors) < TOL, errors


def _refused(rank, world):
    q = torch.zeros(1, 2, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="use allgather or a2a"):
        context_parallel_attention(q, q, q, dist.group.WORLD, "p2p", window=2)
    return True


def test_p2p_refuses_a_window():
    assert all(run_ranks(_refused, 2, timeout=30))
