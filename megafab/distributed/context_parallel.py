"""Context parallelism: every sequence split over the CP group, attention exact across the pieces.

Layout (Megatron's causal load balancing): the sequence of length s is cut into 2*cp chunks of
c = s / (2*cp) tokens; CP rank r holds chunks r and 2*cp-1-r, concatenated, so every rank gets the
same share of causal work:

    cp = 2, s = 8:   chunks [0 1 | 2 3 | 4 5 | 6 7]      rank 0: chunks 0, 3 -> tokens 0 1 6 7
                                                         rank 1: chunks 1, 2 -> tokens 2 3 4 5

Everything outside attention is token-wise, so it runs on the local s/cp tokens unchanged; only
positions (learned or RoPE) must be the tokens' global ones (`local_token_positions`) and the loss
is averaged over the whole sequence (`context_parallel_masked_mean`). Attention (causal, GQA) has
three variants, Megatron's --cp-comm-type:

  p2p        ring: K/V blocks travel round the CP group (cp - 1 steps, the next block's transfer
             overlapping the current block's compute); partial results merge by log-sum-exp.
             Backward runs the ring again, dK/dV travelling with K/V back to their owner.
  allgather  K/V all-gathered (and re-gathered in backward, so only local K/V is saved); dK/dV
             reduce-scattered.
  a2a        DeepSpeed-Ulysses: an all-to-all trades the sequence split for a head split
             ([b, heads, s/cp, d] -> [b, heads/cp, s, d]), plain SDPA runs on whole sequences,
             a second all-to-all trades back. Needs heads/TP and query groups/TP divisible by cp.

p2p and allgather compute blocks with blockwise_attention.py and save only q, k, v, out and the
log-sum-exp (flash attention's set) for this rank's tokens; a2a saves what SDPA saves, for
heads/cp of the whole sequence: the same bytes.

RNG: attention dropout under p2p/allgather draws one seed per call from the stream the caller is
in (SelfAttention forks the model-parallel stream, which differs across TP and CP ranks) and
derives each block's mask from it (BlockDropout), so backward and recompute see the same masks;
a2a's SDPA draws from that stream directly. Masks differ from a CP-1 run's (different blocks).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megafab.distributed.blockwise_attention import (
    BlockDropout,
    LseMerge,
    block_backward,
    block_forward,
    compute_dtype,
)
from megafab.distributed.mappings import gather_first_dim, reduce_scatter_first_dim
from megafab.run import faults

KV_TAG, DKV_TAG = 11, 12
COMM_TYPES = ("p2p", "allgather", "a2a")


# ---- layout --------------------------------------------------------------------------------------
def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*cp) that CP rank `cp_rank` holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_token_positions(seq_length: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions [s/cp] of this rank's tokens, in their local order."""
    c = seq_length // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp_rank, cp)])


def local_position_ids(local_length: int, group, device=None) -> torch.Tensor:
    """Positions [s/cp] of the tokens this rank holds (0..s-1 without a CP group)."""
    cp = 1 if group is None else dist.get_world_size(group)
    if cp == 1:
        return torch.arange(local_length, device=device)
    return local_token_positions(local_length * cp, dist.get_rank(group), cp, device)


def split_for_context_parallel(x: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the whole sequence), concatenated."""
    if cp == 1:
        return x
    index = local_token_positions(x.shape[dim], cp_rank, cp, x.device)
    return x.index_select(dim, index)


def _rank_layout_chunks(cp: int) -> list[int]:
    """Chunk ids in the order the CP ranks' pieces concatenate: [0, 2cp-1, 1, 2cp-2, ...]."""
    return [i for r in range(cp) for i in chunk_ids(r, cp)]


def _to_natural_order(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Rank-ordered pieces (rank 0's s/cp tokens, rank 1's, ...) along `dim` -> sequence order."""
    layout = _rank_layout_chunks(cp)
    c = x.shape[dim] // (2 * cp)
    index = torch.cat([torch.arange(layout.index(j) * c, (layout.index(j) + 1) * c)
                       for j in range(2 * cp)]).to(x.device)
    return x.index_select(dim, index)


def _to_rank_order(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    c = x.shape[dim] // (2 * cp)
    index = torch.cat([torch.arange(j * c, (j + 1) * c) for j in _rank_layout_chunks(cp)]).to(x.device)
    return x.index_select(dim, index)


# ---- loss ----------------------------------------------------------------------------------------
def context_parallel_masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor,
                                 group) -> torch.Tensor:
    """sum(loss * mask) / sum(mask) over the whole sequence, whose tokens are spread over `group`.

    Megatron's scheme: the value is the global mean on every CP rank; the gradient is this rank's
    cp * sum(loss * mask) / global sum(mask), so that averaging gradients over DP x CP gives the
    gradient of the global mean (one all-reduce of [sum, count], no autograd collective)."""
    mask = loss_mask.to(per_token_loss.dtype)
    local = torch.stack([(per_token_loss * mask).sum(), mask.sum()])
    if group is None or dist.get_world_size(group) == 1:
        return local[0] / local[1]
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    scaled = local[0] * dist.get_world_size(group) / total[1]
    return scaled + (total[0] / total[1] - scaled).detach()


# ---- communication -------------------------------------------------------------------------------
class _Ring:
    """Neighbour exchange in a CP group: send to the next rank, receive from the previous one."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]
        self.batched = dist.get_backend(group) == "nccl"  # NCCL needs a grouped send/recv pair

    def start(self, tensor: torch.Tensor, tag: int):
        """Post send(tensor) -> next and recv <- prev; returns (received buffer, requests)."""
        received = torch.empty_like(tensor)
        ops = [(dist.isend, tensor, self.next), (dist.irecv, received, self.prev)]
        if self.rank % 2:
            ops.reverse()
        if self.batched:
            requests = dist.batch_isend_irecv([dist.P2POp(op, t, peer, self.group, tag)
                                               for op, t, peer in ops])
        else:
            requests = [op(t, peer, group=self.group, tag=tag) for op, t, peer in ops]
        return received, requests

    @staticmethod
    def finish(pending) -> torch.Tensor:
        received, requests = pending
        for request in requests:
            faults.wait(request, "ring send/recv (context parallel)")
        return received


def _all_gather_kv(kv: torch.Tensor, group) -> torch.Tensor:
    """kv [2, b, g, s/cp, d] of every CP rank -> [2, b, g, s, d] in sequence order."""
    cp = dist.get_world_size(group)
    gathered = gather_first_dim(kv, group).view(cp, *kv.shape)
    gathered = gathered.permute(1, 2, 3, 0, 4, 5)  # [2, b, g, cp, s/cp, d]
    return _to_natural_order(gathered.reshape(*kv.shape[:3], -1, kv.shape[-1]), 3, cp)


def _reduce_scatter_kv(dkv: torch.Tensor, group) -> torch.Tensor:
    """Inverse of _all_gather_kv for gradients: [2, b, g, s, d] summed over CP -> local [2, b, g, s/cp, d]."""
    cp = dist.get_world_size(group)
    ranked = _to_rank_order(dkv, 3, cp)
    two, b, g, s, d = ranked.shape
    pieces = ranked.view(two, b, g, cp, s // cp, d).permute(3, 0, 1, 2, 4, 5).contiguous()
    return reduce_scatter_first_dim(pieces.view(cp * two, b, g, s // cp, d), group)  # [2, b, g, s/cp, d]


class _AllToAll(torch.autograd.Function):
    """Split `scatter_dim` over the group, gather the group's pieces along `gather_dim`."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        cp = dist.get_world_size(group)
        send = torch.stack(x.chunk(cp, dim=scatter_dim)).contiguous()  # [cp, ...piece]
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        return torch.cat(received.unbind(0), dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _AllToAll.apply(grad, ctx.group, gather_dim, scatter_dim), None, None, None


# ---- attention variants --------------------------------------------------------------------------
def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, groups, heads/groups, s, d]."""
    b, h, s, d = x.shape
    return x.view(b, groups, h // groups, s, d)


def _ring_blocks(q_chunks, k_chunks, c: int) -> list[tuple[slice, slice]]:
    """(query rows, key rows) blocks of the local layout with anything visible: a query chunk
    sees key chunks not after it; query halves that see the same keys share one block."""
    per_half = []
    for a, qc in enumerate(q_chunks):
        seen = [b for b, kc in enumerate(k_chunks) if kc <= qc]
        if seen:
            per_half.append((a, slice(min(seen) * c, (max(seen) + 1) * c)))
    if len(per_half) == 2 and per_half[0][1] == per_half[1][1]:
        return [(slice(0, 2 * c), per_half[0][1])]
    return [(slice(a * c, (a + 1) * c), keys) for a, keys in per_half]


def _forward_blocks(merge: LseMerge, qg, kv, q_pos, k_pos, blocks, scale, dropout, first_id: int):
    """Attend qg's rows to kv's rows block by block, merging into `merge`."""
    for i, (rows, keys) in enumerate(blocks):
        out, lse = block_forward(qg[..., rows, :], kv[0][:, :, keys], kv[1][:, :, keys], q_pos[rows],
                                 k_pos[keys], scale, dropout, first_id + i)
        merge.add(rows, out, lse)


class _Grads:
    """What a block backward reads, from the forward's saved q, k, v, out, lse and dout."""

    def __init__(self, ctx, saved: tuple, dout: torch.Tensor, q_pos: torch.Tensor):
        q, k, v, out, self.lse = saved  # ctx.saved_tensors, read once (recompute allows no more)
        acc = compute_dtype(q.dtype)
        self.q, self.k, self.v = q, k, v
        self.qg = _grouped(q, k.shape[1])
        self.dout = _grouped(dout.to(acc), k.shape[1])
        self.delta = (self.dout * _grouped(out, k.shape[1]).to(acc)).sum(-1)  # rowsum(dout * out)
        self.dq = torch.zeros_like(self.qg, dtype=acc)
        self.q_pos, self.scale, self.dropout = q_pos, ctx.scale, ctx.dropout

    def result(self, dkv: torch.Tensor) -> tuple:
        q, k, v = self.q, self.k, self.v
        return self.dq.view_as(q).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _backward_blocks(grads: _Grads, kv, dkv, k_pos, blocks, first_id: int):
    """Add the blocks' dq into grads.dq and their dk, dv into dkv [2, b, g, sk, d]."""
    for i, (rows, keys) in enumerate(blocks):
        dq, dk, dv = block_backward(
            grads.qg[..., rows, :], kv[0][:, :, keys], kv[1][:, :, keys], grads.q_pos[rows], k_pos[keys],
            grads.lse[..., rows], grads.dout[..., rows, :], grads.delta[..., rows], grads.scale,
            grads.dropout, first_id + i)
        grads.dq[..., rows, :] += dq
        dkv[0][:, :, keys] += dk
        dkv[1][:, :, keys] += dv


def _sbhd_layout(x: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] stored as [s, b, heads, d], the layout SDPA's flash kernels return: the
    caller's permute-and-reshape to [s, b, h] is then a view, not a second saved copy."""
    return x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


def _save(ctx, q, k, v, merge: LseMerge, group, dropout, scale) -> torch.Tensor:
    out = _sbhd_layout(merge.out.view_as(q)).to(q.dtype)
    ctx.save_for_backward(q, k, v, out, merge.lse)
    ctx.group, ctx.dropout, ctx.scale = group, dropout, scale
    return out


def _setup(q, group, dropout_p: float, seed: int):
    """(cp, rank, chunk length c, scale, dropout, this rank's query positions)."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    dropout = BlockDropout(dropout_p, seed) if dropout_p > 0 else None
    q_pos = local_token_positions(q.shape[2] * cp, r, cp, q.device)
    return cp, r, q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1]), dropout, q_pos


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, dropout_p: float, seed: int):
        cp, r, c, scale, dropout, q_pos = _setup(q, group, dropout_p, seed)
        ring = _Ring(group)
        qg = _grouped(q, k.shape[1])
        merge = LseMerge(qg)
        kv = torch.stack([k, v])
        for step in range(cp):
            pending = ring.start(kv, KV_TAG) if step < cp - 1 else None
            src = (r - step) % cp
            _forward_blocks(merge, qg, kv, q_pos, local_token_positions(2 * c * cp, src, cp, q.device),
                            _ring_blocks(chunk_ids(r, cp), chunk_ids(src, cp), c), scale, dropout, 4 * step)
            if pending is not None:
                kv = ring.finish(pending)
        return _save(ctx, q, k, v, merge, group, dropout, scale)

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        cp, r, c, _, _, q_pos = _setup(saved[0], ctx.group, 0.0, 0)
        ring = _Ring(ctx.group)
        grads = _Grads(ctx, saved, dout, q_pos)
        kv = torch.stack([grads.k, grads.v])
        dkv = torch.zeros_like(kv, dtype=grads.dq.dtype)
        for step in range(cp):
            pending = ring.start(kv, KV_TAG) if step < cp - 1 else None
            src = (r - step) % cp
            _backward_blocks(grads, kv, dkv, local_token_positions(2 * c * cp, src, cp, dout.device),
                             _ring_blocks(chunk_ids(r, cp), chunk_ids(src, cp), c), 4 * step)
            # dK/dV follow K/V round the ring; after the last step each rank holds its own, complete.
            dkv = ring.finish(ring.start(dkv, DKV_TAG))
            if pending is not None:
                kv = ring.finish(pending)
        return grads.result(dkv)


def _allgather_blocks(r: int, cp: int, c: int) -> list[tuple[slice, slice]]:
    """Each local query chunk against every key up to its own chunk's end."""
    return [(slice(a * c, (a + 1) * c), slice(0, (qc + 1) * c)) for a, qc in enumerate(chunk_ids(r, cp))]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, dropout_p: float, seed: int):
        cp, r, c, scale, dropout, q_pos = _setup(q, group, dropout_p, seed)
        qg = _grouped(q, k.shape[1])
        merge = LseMerge(qg)
        _forward_blocks(merge, qg, _all_gather_kv(torch.stack([k, v]), group), q_pos,
                        torch.arange(2 * c * cp, device=q.device), _allgather_blocks(r, cp, c), scale,
                        dropout, 0)
        return _save(ctx, q, k, v, merge, group, dropout, scale)

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        cp, r, c, _, _, q_pos = _setup(saved[0], ctx.group, 0.0, 0)
        grads = _Grads(ctx, saved, dout, q_pos)
        kv = _all_gather_kv(torch.stack([grads.k, grads.v]), ctx.group)  # gathered again, not saved
        dkv = torch.zeros_like(kv, dtype=grads.dq.dtype)
        _backward_blocks(grads, kv, dkv, torch.arange(2 * c * cp, device=dout.device),
                         _allgather_blocks(r, cp, c), 0)
        return grads.result(_reduce_scatter_kv(dkv, ctx.group))


def _ulysses_attention(q, k, v, group, dropout_p: float) -> torch.Tensor:
    """a2a: heads scattered, sequences gathered (in sequence order), causal SDPA, and back."""
    cp = dist.get_world_size(group)

    def to_heads(x):  # [b, n, s/cp, d] -> [b, n/cp, s, d]
        return _to_natural_order(_AllToAll.apply(x, group, 1, 2), 2, cp)

    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    if q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return _sbhd_layout(_AllToAll.apply(_to_rank_order(out, 2, cp), group, 2, 1))


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                               comm_type: str = "p2p", dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's tokens against the whole sequence spread over `group`.

    q [b, heads, s/cp, d]; k, v [b, groups, s/cp, d] (GQA: not repeated); local token order as in
    the module docstring. Returns [b, heads, s/cp, d]. Run it inside the RNG stream that attention
    dropout should draw from.
    """
    if comm_type == "a2a":
        return _ulysses_attention(q, k, v, group, dropout_p)
    seed = int(torch.randint(0, 1 << 62, (1,), device=q.device).item()) if dropout_p > 0 else 0
    if comm_type == "p2p":
        return _RingAttention.apply(q, k, v, group, dropout_p, seed)
    if comm_type == "allgather":
        return _AllGatherAttention.apply(q, k, v, group, dropout_p, seed)
    raise ValueError(f"unknown CP comm type {comm_type!r}; expected one of {', '.join(COMM_TYPES)}")
