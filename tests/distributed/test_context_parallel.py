"""Context-parallel attention (fused kernels and the portable reference) against one process's
attention, the block plans, the sequence layout, the CP loss and the reference kernel's dropout
(float64, gloo)."""

import pytest
import torch
import torch.distributed as dist

from megafab.distributed import blockwise_attention as ba
from megafab.distributed.context_parallel import (
    _rank_layout_chunks,
    _to_natural_order,
    _to_rank_order,
    allgather_plan,
    chunk_ids,
    context_parallel_attention,
    context_parallel_masked_mean,
    local_token_positions,
    ring_plan,
    split_for_context_parallel,
)
from megafab.distributed.fused_attention import CPU_FLASH, block_kernel
from megafab.distributed.random import (
    RNGStatesTracker,
    checkpoint_rng_state,
    host_seed,
    model_parallel_seed,
    restore_rng_state,
)
from megafab.run.fork_ranks import run_ranks

TOL = 1e-10


def test_megatron_load_balanced_chunks():
    # cp 2, s 8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (of 4 chunks of 2 tokens)
    assert [chunk_ids(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert local_token_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_token_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert _rank_layout_chunks(4) == (0, 7, 1, 6, 2, 5, 3, 4)
    # the ranks' pieces tile the sequence exactly once
    for cp in (1, 2, 4):
        got = torch.cat([local_token_positions(32, r, cp) for r in range(cp)]).sort().values
        assert got.tolist() == list(range(32))


def test_rank_order_and_sequence_order_are_inverse():
    x = torch.arange(2 * 16).view(2, 16)
    for cp in (2, 4):
        ranked = torch.cat([split_for_context_parallel(x, 1, r, cp) for r in range(cp)], dim=1)
        assert torch.equal(_to_natural_order(ranked, 1, cp), x)
        assert torch.equal(_to_rank_order(x, 1, cp), ranked)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_block_plans_cover_every_causal_pair_once_with_exact_masks(cp):
    """Every (query, key) pair with key <= query lies in exactly one block, and each block's own
    mask (full, or causal on a square diagonal) is exactly the positional one."""
    c = 3
    s = 2 * cp * c
    natural = torch.arange(s)
    for plan_of in ("p2p", "allgather"):
        seen = torch.zeros(s, s, dtype=torch.int64)
        for r in range(cp):
            q_pos = local_token_positions(s, r, cp)
            if plan_of == "p2p":
                steps = [(local_token_positions(s, (r - i) % cp, cp), blocks)
                         for i, blocks in enumerate(ring_plan(c, cp, r))]
            else:
                local, gathered = allgather_plan(c, cp, r)
                steps = [(q_pos, local), (natural, gathered)]
            covered = torch.zeros(2 * c, dtype=torch.bool)
            for k_pos, blocks in steps:
                for blk in blocks:
                    qs, ks = q_pos[blk.rows], k_pos[blk.keys]
                    allowed = ks[None, :] <= qs[:, None]
                    if blk.causal:
                        assert len(qs) == len(ks) and torch.equal(allowed, torch.ones_like(allowed).tril())
                    else:
                        assert allowed.all()
                    assert blk.first == (not covered[blk.rows].any())
                    covered[blk.rows] = True
                    pairs = qs[:, None].expand_as(allowed)[allowed], ks[None, :].expand_as(allowed)[allowed]
                    seen[pairs] += 1
        assert torch.equal(seen, torch.ones_like(seen).tril()), plan_of


def _math_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v with the causal mask, spelled out (GQA by repeating K/V)."""
    hpg = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(hpg, 1), v.repeat_interleave(hpg, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ v


def _attention_parity(rank, world, comm, heads, groups, dtype, implementation="auto"):
    torch.manual_seed(0)
    b, s, d = 2, 8 * world, 8
    q = torch.randn(b, heads, s, d, dtype=torch.float64)
    k = torch.randn(b, groups, s, d, dtype=torch.float64)
    v = torch.randn(b, groups, s, d, dtype=torch.float64)
    dout = torch.randn(b, heads, s, d, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _math_attention(qr, kr, vr)
    ref.backward(dout)

    def local(t):
        return split_for_context_parallel(t, 2, rank, world).to(dtype)

    ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, dist.group.WORLD, comm, implementation=implementation)
    assert out.dtype == dtype and out.shape == ql.shape
    out.backward(local(dout))
    errors = [(out.double() - local(ref).double()).abs().max().item()]
    for mine, full in ((ql, qr), (kl, kr), (vl, vr)):
        errors.append((mine.grad.double() - local(full.grad).double()).abs().max().item())
    return errors


@pytest.mark.parametrize("comm", ["p2p", "allgather", "a2a"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_and_its_gradients_equal_full_sequence_attention(comm, cp):
    """float64: the fused CPU flash kernel (it takes float64) against one process's math."""
    groups = 4 if comm == "a2a" and cp == 4 else 2  # a2a splits the key/value heads over CP
    for errors in run_ranks(_attention_parity, cp, comm, 8, groups, torch.float64, timeout=60):
        assert max(errors) < TOL, errors


@pytest.mark.parametrize("comm", ["p2p", "allgather"])
def test_portable_reference_equals_full_sequence_attention(comm):
    for errors in run_ranks(_attention_parity, 2, comm, 8, 2, torch.float64, "reference", timeout=60):
        assert max(errors) < TOL, errors


def test_fused_kernels_are_chosen_on_cpu_and_the_reference_for_dropout():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert block_kernel(torch.zeros(1, 2, 4, 8, dtype=dtype)) is CPU_FLASH
    assert isinstance(block_kernel(torch.zeros(1, 2, 4, 8), 0.1, 7), ba.ReferenceKernel)
    assert isinstance(block_kernel(torch.zeros(1, 2, 4, 8), implementation="reference"), ba.ReferenceKernel)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_block_kernel_equals_the_reference_block_kernel(causal):
    """One block, GQA, float64, forward and backward from a given (merged-like) out and lse."""
    torch.manual_seed(4)
    b, heads, groups, sq, d = 2, 4, 2, 6, 8
    sk = sq if causal else 10
    q = torch.randn(b, heads, sq, d, dtype=torch.float64)
    k, v = (torch.randn(b, groups, sk, d, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(b, heads, sq, d, dtype=torch.float64)
    ref_out, ref_lse, _ = ba.ReferenceKernel().forward(q, k, v, causal, 0.3)
    out, lse, aux = CPU_FLASH.forward(q, k, v, causal, 0.3)
    assert (out - ref_out).abs().max() < TOL and (lse - ref_lse).abs().max() < TOL
    grads = CPU_FLASH.backward(dout, q, k, v, out, lse, causal, 0.3, 0, aux)
    ref_grads = ba.ReferenceKernel().backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3)
    for mine, theirs in zip(grads, ref_grads):
        assert mine.shape == theirs.shape and (mine - theirs).abs().max() < TOL


def test_bf16_ring_attention_stays_close_to_fp64():
    for errors in run_ranks(_attention_parity, 2, "p2p", 4, 2, torch.bfloat16, timeout=60):
        assert max(errors) < 0.05, errors


def _loss(rank, world):
    g = torch.Generator().manual_seed(3)
    loss = torch.rand(2, 16, generator=g, dtype=torch.float64)
    mask = (torch.rand(2, 16, generator=g) > 0.3).double()
    mask[0, :] = 0.0  # a sample whose whole first half is masked still counts the rest
    expected = (loss * mask).sum() / mask.sum()
    mine = split_for_context_parallel(loss, 1, rank, world).requires_grad_()
    value = context_parallel_masked_mean(mine, split_for_context_parallel(mask, 1, rank, world),
                                         dist.group.WORLD)
    value.backward()
    # DDP averages over CP: (1/cp) * sum over ranks of each rank's gradient = d(global mean)
    grad = mine.grad / world
    full = loss.clone().requires_grad_()
    ((full * mask).sum() / mask.sum()).backward()
    return (value - expected).abs().item(), (grad - split_for_context_parallel(full.grad, 1, rank, world)
                                             ).abs().max().item()


def test_loss_is_the_mean_over_the_whole_sequence():
    for value_err, grad_err in run_ranks(_loss, 2, timeout=30):
        assert value_err < TOL and grad_err < TOL


def _naive_block(q, k, v, scale, dropout, block_id):
    """A causal block by autograd, with the kernel's own dropout masks, for the backward check."""
    hpg = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(hpg, 1), v.repeat_interleave(hpg, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    keep = dropout.keep(block_id, 0, p.unflatten(1, (k.shape[1] // hpg, hpg)).shape, p.device)
    return torch.matmul(p * keep.flatten(1, 2).double() / (1.0 - dropout.p), v)


def test_reference_kernel_with_dropout_matches_autograd_of_the_same_masks():
    torch.manual_seed(1)
    b, g, hpg, s, d = 2, 2, 2, 6, 4
    q = torch.randn(b, g * hpg, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, g, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, g, s, d, dtype=torch.float64, requires_grad=True)
    dropout, scale = ba.BlockDropout(0.3, 12345), 0.5
    kernel = ba.ReferenceKernel(dropout)
    out, lse, _ = kernel.forward(q, k, v, True, scale, block_id=7)
    ref = _naive_block(q, k, v, scale, dropout, 7)
    assert (out - ref).abs().max() < TOL
    dout = torch.randn_like(ref)
    ref.backward(dout)
    # delta = rowsum(dout * out): with dropout this is still the softmax's normalisation term
    dq, dk, dv = kernel.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, True, scale, block_id=7)
    for mine, full in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert (mine - full).abs().max() < TOL
    kept = dropout.keep(7, 0, (1000, 100), "cpu").double().mean().item()
    assert abs(kept - 0.7) < 0.01
    assert not torch.equal(dropout.keep(7, 0, (50, 50), "cpu"), dropout.keep(8, 0, (50, 50), "cpu"))


@pytest.mark.parametrize("causal", [True, False])
def test_query_tiles_give_the_untiled_result(monkeypatch, causal):
    torch.manual_seed(2)
    q = torch.randn(1, 2, 12, 4, dtype=torch.float64)
    k, v = torch.randn(1, 2, 12, 4, dtype=torch.float64), torch.randn(1, 2, 12, 4, dtype=torch.float64)
    dout = torch.randn(1, 2, 12, 4, dtype=torch.float64)
    kernel = ba.ReferenceKernel()
    whole = kernel.forward(q, k, v, causal, 0.5)[:2]
    whole_grads = kernel.backward(dout, q, k, v, *whole, causal, 0.5)
    monkeypatch.setattr(ba, "TILE_ELEMENTS", 2 * 12 * 5)  # 5 query rows per tile
    tiled = kernel.forward(q, k, v, causal, 0.5)[:2]
    tiled_grads = kernel.backward(dout, q, k, v, *whole, causal, 0.5)
    assert all((a - b).abs().max() < TOL for a, b in zip(whole + whole_grads, tiled + tiled_grads))


def _dropout_differs_across_cp_ranks(rank, world, comm):
    torch.manual_seed(5)  # same inputs on both ranks: the seeds must come from a per-rank stream
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    k, v = torch.randn(1, 2, 8, 4, dtype=torch.float64), torch.ones(1, 2, 8, 4, dtype=torch.float64)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(77, 0, 0, "cpu", tracker, cp_rank=rank)
    states = checkpoint_rng_state(tracker, "cpu")

    def attention(dropout_p):
        with tracker.fork():  # as SelfAttention runs it; a2a draws from the forked stream itself
            seed = host_seed(tracker) if comm != "a2a" else None
            return context_parallel_attention(q, k, v, dist.group.WORLD, comm, dropout_p, seed)

    first = attention(0.5)
    restore_rng_state(states, tracker, "cpu")
    again = attention(0.5)
    plain = attention(0.0)
    assert torch.equal(first, again)  # the stream decides the masks: recompute replays them
    assert not torch.equal(first, plain)
    gathered = [torch.empty_like(first) for _ in range(world)]
    dist.all_gather(gathered, first)
    return not torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize("comm", ["p2p", "allgather", "a2a"])
def test_attention_dropout_follows_the_rank_stream(comm):
    assert all(run_ranks(_dropout_differs_across_cp_ranks, 2, comm, timeout=30))
