"""RNG tracker: reproducible, per-TP-rank streams inside fork(), shared streams outside, and
states that round-trip (checkpoints, recompute). CPU path, plus a CUDA test when a GPU exists."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megafab.distributed.random import (
    RNGStatesTracker,
    checkpoint_rng_state,
    model_parallel_seed,
    restore_rng_state,
)
from megafab.distributed.topology import build_topology
from megafab.run.fork_ranks import run_ranks

CPU = torch.device("cpu")


def dropout_mask(device=CPU, n=256):
    return F.dropout(torch.ones(n, dtype=torch.float64, device=device), p=0.5, training=True) != 0


def all_gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _draw_masks(rank, world, tp, pp):
    topo = build_topology(tp=tp, pp=pp)
    tracker = RNGStatesTracker(topo.device)
    seeds = model_parallel_seed(1234, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    assert seeds["default"] == 1234 + 100 * topo.pp_rank
    assert seeds["model-parallel-rng"] == 1234 + 100 * topo.pp_rank + 2718 + topo.tp_rank
    outside_1 = dropout_mask()
    with tracker.fork():
        inside = dropout_mask()
    outside_2 = dropout_mask()
    masks = torch.stack([outside_1, inside, outside_2]).to(torch.uint8)

    tp_masks = all_gather(masks, topo.group("tp"))
    for other in tp_masks:
        assert torch.equal(other[0], masks[0]) and torch.equal(other[2], masks[2]), "outside fork"
    for i in range(tp):
        for j in range(i + 1, tp):
            assert not torch.equal(tp_masks[i][1], tp_masks[j][1]), "inside fork, TP ranks must differ"
    if pp > 1:
        pp_masks = all_gather(masks, topo.group("pp"))
        assert not torch.equal(pp_masks[0][0], pp_masks[1][0]), "pipeline stages must differ"
    if topo.dp > 1:  # DP replicas share every stream (Megatron's default)
        for other in all_gather(masks, topo.group("dp")):
            assert torch.equal(other, masks)
    return masks


def test_masks_per_tp_rank_inside_fork_shared_outside_and_reproducible():
    first = run_ranks(_draw_masks, 8, 2, 2, timeout=90)  # tp 2, pp 2, dp 2
    second = run_ranks(_draw_masks, 8, 2, 2, timeout=90)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "two runs with the same seed must be bit-identical"


def _masks_at_tp4(rank, world):
    _draw_masks(rank, world, 4, 1)
    return True


def test_four_tp_ranks_draw_four_different_masks():
    assert run_ranks(_masks_at_tp4, 4, timeout=60) == [True] * 4


def test_fork_leaves_the_default_stream_where_it_was():
    tracker = RNGStatesTracker(CPU)
    model_parallel_seed(7, 0, 0, CPU, tracker)
    a, b = dropout_mask(), dropout_mask()
    model_parallel_seed(7, 0, 0, CPU, tracker)
    a2 = dropout_mask()
    with tracker.fork():
        forked = dropout_mask()
    b2 = dropout_mask()
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(forked, b2)
    with tracker.fork():  # the named stream continues where it stopped
        assert not torch.equal(dropout_mask(), forked)


def test_get_set_states_round_trip():
    tracker = RNGStatesTracker(CPU)
    model_parallel_seed(11, 1, 0, CPU, tracker)
    saved = tracker.get_states()
    assert set(saved) == {"model-parallel-rng", "data-parallel-rng"}
    assert all(s.dtype == torch.uint8 and s.device.type == "cpu" for s in saved.values())
    with tracker.fork():
        first = dropout_mask()
    tracker.set_states(saved)
    with tracker.fork():
        again = dropout_mask()
    assert torch.equal(first, again)

    restored = RNGStatesTracker(CPU)  # a fresh tracker (a resumed run) continues identically
    restored.set_states(tracker.get_states())
    with tracker.fork():
        x = dropout_mask()
    with restored.fork():
        y = dropout_mask()
    assert torch.equal(x, y)


def test_checkpoint_and_restore_rng_state_replays_default_and_tracker_streams():
    tracker = RNGStatesTracker(CPU)
    model_parallel_seed(3, 0, 1, CPU, tracker)
    snapshot = checkpoint_rng_state(tracker, CPU)

    def forward():
        outside = dropout_mask()
        with tracker.fork():
            inside = dropout_mask()
        return outside, inside

    first = forward()
    restore_rng_state(snapshot, tracker, CPU)
    replay = forward()
    assert torch.equal(first[0], replay[0]) and torch.equal(first[1], replay[1])
    assert not torch.equal(forward()[1], first[1])


def test_misuse_is_reported_with_the_fix():
    tracker = RNGStatesTracker(CPU)
    with pytest.raises(ValueError, match="never added .* model_parallel_seed"):
        with tracker.fork():
            pass
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="tracker is on cpu"):
        model_parallel_seed(1, 0, 0, torch.device("cuda", 0), tracker)


def test_cpu_path_makes_no_cuda_call(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("CUDA called on the CPU path")

    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "current_device",
                 "device", "is_available", "init"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    tracker = RNGStatesTracker(CPU)
    model_parallel_seed(5, 1, 1, CPU, tracker)
    with tracker.fork():
        dropout_mask()
    restore_rng_state(checkpoint_rng_state(tracker, CPU), tracker, CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on GPU machines)")
def test_cuda_tracker_uses_the_device_generator():
    cuda = torch.device("cuda", 0)
    tracker = RNGStatesTracker(cuda)
    model_parallel_seed(9, 0, 0, cuda, tracker)
    cpu_state = torch.get_rng_state()
    a = dropout_mask(cuda)
    with tracker.fork():
        inside = dropout_mask(cuda)
    assert torch.equal(torch.get_rng_state(), cpu_state), "CUDA dropout must not touch the CPU stream"
    model_parallel_seed(9, 0, 0, cuda, tracker)
    snapshot = checkpoint_rng_state(tracker, cuda)
    assert torch.equal(dropout_mask(cuda), a)
    with tracker.fork():
        assert torch.equal(dropout_mask(cuda), inside)
    restore_rng_state(snapshot, tracker, cuda)
    assert torch.equal(dropout_mask(cuda), a)
    assert not torch.equal(a, inside)
