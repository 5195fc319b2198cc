"""Context-parallel attention without host-device synchronization, its dK/dV exchange overlapped with
the next block's backward, and the host-side dropout seeds it takes from the RNG tracker."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megafab.distributed import context_parallel as cpa
from megafab.distributed.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint_rng_state,
    host_seed,
    model_parallel_seed,
    restore_rng_state,
)
from megafab.run.fork_ranks import run_ranks

# Every way a tensor's value reaches Python: on CUDA each is a device-to-host copy and a sync.
READBACKS = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def counting_readbacks():
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READBACKS}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _readbacks_in_forward_and_backward(rank, world, comm, dropout_p, implementation):
    torch.manual_seed(rank)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1, 0, 0, "cpu", tracker, cp_rank=rank)
    for _ in range(2):  # the second call runs on the cached plans
        with counting_readbacks() as calls, tracker.fork():
            seed = host_seed(tracker) if dropout_p > 0 else None
            out = cpa.context_parallel_attention(q, k, v, dist.group.WORLD, comm, dropout_p, seed,
                                                 implementation)
            out.backward(torch.ones_like(out))
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0  # outside the counted region
    return calls


@pytest.mark.parametrize("comm,dropout_p,implementation", [
    ("p2p", 0.0, "auto"), ("allgather", 0.0, "auto"), ("a2a", 0.0, "auto"),
    ("p2p", 0.2, "auto"), ("allgather", 0.0, "reference")])
def test_cp_attention_reads_nothing_back_from_the_device(comm, dropout_p, implementation):
    runs = run_ranks(_readbacks_in_forward_and_backward, 2, comm, dropout_p, implementation, timeout=60)
    assert runs == [[], []]


def test_the_readback_counter_sees_a_readback():
    with counting_readbacks() as calls:
        torch.ones(2).sum().item()
        bool(torch.ones(()) > 0)
    assert calls == ["item", "__bool__"]


def _exchange_order(rank, world):
    events, alive = [], []  # alive: no id() of a finished exchange is reused
    start, finish = cpa._Ring.start, cpa._Ring.finish

    def logged_start(self, tensor, tag):
        pending = start(self, tensor, tag)
        alive.append(pending)
        events.append(("start", tag, id(pending)))
        return pending

    def logged_finish(pending):
        events.append(("finish", None, id(pending)))
        return finish(pending)

    class LoggedKernel:
        def __init__(self, kernel):
            self.kernel = kernel

        def forward(self, *args):
            return self.kernel.forward(*args)

        def backward(self, *args):
            events.append(("block backward", None, None))
            return self.kernel.backward(*args)

    block_kernel = cpa.block_kernel
    cpa._Ring.start, cpa._Ring.finish = logged_start, staticmethod(logged_finish)
    cpa.block_kernel = lambda *args: LoggedKernel(block_kernel(*args))
    try:
        q = torch.randn(1, 2, 12, 4, requires_grad=True)
        out = cpa.context_parallel_attention(q, torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 4),
                                             dist.group.WORLD, "p2p")
        events.clear()
        out.sum().backward()
    finally:
        cpa._Ring.start, cpa._Ring.finish, cpa.block_kernel = start, staticmethod(finish), block_kernel
    return events


def test_dkv_exchange_overlaps_the_next_blocks_backward():
    """cp 3: each step's dK/dV send/receive is started after its block and waited on only after
    the next step's block backward ran; the last one is waited on at the end."""
    for events in run_ranks(_exchange_order, 3, timeout=60):
        dkv = [e for e in events if e[1] == cpa.DKV_TAG]
        blocks = [i for i, e in enumerate(events) if e[0] == "block backward"]
        assert len(dkv) == 3 and len(blocks) == 3
        for step, (_, _, pending) in enumerate(dkv):
            started = events.index(("start", cpa.DKV_TAG, pending))
            waited = events.index(("finish", None, pending))
            assert blocks[step] < started
            if step < 2:
                assert blocks[step + 1] < waited
            else:
                assert waited == len(events) - 1


def test_host_seeds_replay_with_the_rng_snapshot_and_differ_per_stream_and_draw():
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, 0, 0, "cpu", tracker)
    snapshot = checkpoint_rng_state(tracker, "cpu")  # what recompute and checkpoints keep
    assert snapshot["host_draws"][MODEL_PARALLEL_RNG] == [1234 + 2718, 0]
    first = [host_seed(tracker) for _ in range(3)]
    assert len(set(first)) == 3 and all(0 <= s < 1 << 62 for s in first)
    restore_rng_state(snapshot, tracker, "cpu")
    assert [host_seed(tracker) for _ in range(3)] == first
    other = RNGStatesTracker("cpu")
    model_parallel_seed(1234, 1, 0, "cpu", other)  # another TP rank: another stream
    assert host_seed(other) != first[0]
    old_snapshot = {k: v for k, v in snapshot.items() if k != "host_draws"}
    restore_rng_state(old_snapshot, tracker, "cpu")  # a checkpoint from before host counters: kept
    assert host_seed(tracker) not in first
