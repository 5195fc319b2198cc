"""Context-parallel attention against full-sequence SDPA, the sequence layout, the CP loss and the
block kernels' dropout (float64, gloo)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megafab.distributed import blockwise_attention as ba
from megafab.distributed.context_parallel import (
    _rank_layout_chunks,
    _ring_blocks,
    _to_natural_order,
    _to_rank_order,
    chunk_ids,
    context_parallel_attention,
    context_parallel_masked_mean,
    local_token_positions,
    split_for_context_parallel,
)
from tests.harness import run_ranks

TOL = 1e-10


def test_megatron_load_balanced_chunks():
    # cp 2, s 8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (of 4 chunks of 2 tokens)
    assert [chunk_ids(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert local_token_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_token_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert _rank_layout_chunks(4) == [0, 7, 1, 6, 2, 5, 3, 4]
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
def test_ring_blocks_cover_every_causal_pair_once(cp):
    c = 3
    seen = torch.zeros(2 * cp * c, 2 * cp * c, dtype=torch.int64)
    for r in range(cp):
        q_pos = local_token_positions(2 * cp * c, r, cp)
        for step in range(cp):
            src = (r - step) % cp
            k_pos = local_token_positions(2 * cp * c, src, cp)
            for rows, keys in _ring_blocks(chunk_ids(r, cp), chunk_ids(src, cp), c):
                qs, ks = q_pos[rows], k_pos[keys]
                allowed = ks[None, :] <= qs[:, None]
                assert allowed.any(dim=1).all()  # no query row of a block is fully masked
                seen[qs[:, None].expand_as(allowed)[allowed], ks[None, :].expand_as(allowed)[allowed]] += 1
    assert torch.equal(seen, torch.ones_like(seen).tril())


def _attention_parity(rank, world, comm, heads, groups, dtype):
    torch.manual_seed(0)
    b, s, d = 2, 8 * world, 8
    q = torch.randn(b, heads, s, d, dtype=torch.float64)
    k = torch.randn(b, groups, s, d, dtype=torch.float64)
    v = torch.randn(b, groups, s, d, dtype=torch.float64)
    dout = torch.randn(b, heads, s, d, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    hpg = heads // groups
    ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(hpg, 1), vr.repeat_interleave(hpg, 1),
                                         is_causal=True)
    ref.backward(dout)

    def local(t):
        return split_for_context_parallel(t, 2, rank, world).to(dtype)

    ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, dist.group.WORLD, comm)
    assert out.dtype == dtype and out.shape == ql.shape
    out.backward(local(dout))
    errors = [(out.double() - local(ref).double()).abs().max().item()]
    for mine, full in ((ql, qr), (kl, kr), (vl, vr)):
        errors.append((mine.grad.double() - local(full.grad).double()).abs().max().item())
    return errors


@pytest.mark.parametrize("comm", ["p2p", "allgather", "a2a"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_and_its_gradients_equal_full_sequence_sdpa(comm, cp):
    groups = 4 if comm == "a2a" and cp == 4 else 2  # a2a splits the key/value heads over CP
    for errors in run_ranks(_attention_parity, cp, comm, 8, groups, torch.float64, timeout=60):
        assert max(errors) < TOL, errors


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


def _naive_block(q, k, v, q_pos, k_pos, scale, dropout, block_id):
    """The block by autograd, with the kernel's own dropout masks, for the backward check."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    keep = dropout.keep(block_id, 0, p.shape, p.device).double() / (1.0 - dropout.p)
    return torch.matmul(p * keep, v.unsqueeze(2))


def test_block_kernels_with_dropout_match_autograd_of_the_same_masks():
    torch.manual_seed(1)
    b, g, hpg, sq, sk, d = 2, 2, 2, 6, 10, 4
    q = torch.randn(b, g, hpg, sq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, g, sk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, g, sk, d, dtype=torch.float64, requires_grad=True)
    q_pos, k_pos = torch.arange(4, 4 + sq), torch.arange(sk)
    dropout, scale = ba.BlockDropout(0.3, 12345), 0.5
    out, lse = ba.block_forward(q, k, v, q_pos, k_pos, scale, dropout, block_id=7)
    ref = _naive_block(q, k, v, q_pos, k_pos, scale, dropout, 7)
    assert (out - ref).abs().max() < TOL
    dout = torch.randn_like(ref)
    ref.backward(dout)
    # delta = rowsum(dout * out): with dropout this is still the softmax's normalisation term
    dq, dk, dv = ba.block_backward(q.detach(), k.detach(), v.detach(), q_pos, k_pos, lse, dout,
                                   (dout * out).sum(-1), scale, dropout, block_id=7)
    for mine, full in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert (mine - full).abs().max() < TOL
    kept = dropout.keep(7, 0, (1000, 100), "cpu").double().mean().item()
    assert abs(kept - 0.7) < 0.01
    assert not torch.equal(dropout.keep(7, 0, (50, 50), "cpu"), dropout.keep(8, 0, (50, 50), "cpu"))


def test_query_tiles_give_the_untiled_result(monkeypatch):
    torch.manual_seed(2)
    q = torch.randn(1, 2, 1, 12, 4, dtype=torch.float64)
    k, v = torch.randn(1, 2, 12, 4, dtype=torch.float64), torch.randn(1, 2, 12, 4, dtype=torch.float64)
    pos = torch.arange(12)
    whole = ba.block_forward(q, k, v, pos, pos, 0.5)
    monkeypatch.setattr(ba, "TILE_ELEMENTS", 2 * 12 * 5)  # 5 query rows per tile
    tiled = ba.block_forward(q, k, v, pos, pos, 0.5)
    assert all((a - b).abs().max() < TOL for a, b in zip(whole, tiled))


def _dropout_differs_across_cp_ranks(rank, world, comm):
    torch.manual_seed(5)  # same stream on both ranks: the seeds must come from a per-rank stream
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    k, v = torch.randn(1, 2, 8, 4, dtype=torch.float64), torch.ones(1, 2, 8, 4, dtype=torch.float64)
    torch.manual_seed(77 + rank)
    state = torch.get_rng_state()
    first = context_parallel_attention(q, k, v, dist.group.WORLD, comm, dropout_p=0.5)
    torch.set_rng_state(state)
    again = context_parallel_attention(q, k, v, dist.group.WORLD, comm, dropout_p=0.5)
    plain = context_parallel_attention(q, k, v, dist.group.WORLD, comm)
    assert torch.equal(first, again)  # the stream decides the masks: recompute replays them
    assert not torch.equal(first, plain)
    gathered = [torch.empty_like(first) for _ in range(world)]
    dist.all_gather(gathered, first)
    return not torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize("comm", ["p2p", "allgather", "a2a"])
def test_attention_dropout_follows_the_rank_stream(comm):
    assert all(run_ranks(_dropout_differs_across_cp_ranks, 2, comm, timeout=30))
