"""Context parallelism: every sequence split over the CP group, attention exact across the pieces.

Layout (Megatron's causal load balancing): the sequence is cut into 2*cp chunks and CP rank r holds
chunks r and 2*cp-1-r, concatenated, so every rank gets the same share of causal work (cp = 2,
s = 8: rank 0 holds tokens 0 1 6 7, rank 1 tokens 2 3 4 5). Everything outside attention is
token-wise and runs on the local s/cp tokens unchanged; only positions must be the tokens' global
ones (local_token_positions) and the loss is averaged over the whole sequence
(context_parallel_masked_mean). Attention (causal, GQA) has Megatron's three --cp-comm-type
variants (context_parallel_attention): p2p (a K/V ring, ring_plan), allgather (K/V all-gathered,
allgather_plan) and a2a (DeepSpeed-Ulysses, a head split). p2p and allgather merge blocks by
log-sum-exp on fused kernels (fused_attention.py) and save only flash attention's set (q, k, v,
out, lse) for this rank's tokens. Block plans are host-side slices cached per (chunk length, cp,
rank): no host-device sync inside attention.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megafab.distributed.blockwise_attention import LseMerge, compute_dtype
from megafab.distributed.fused_attention import block_kernel
from megafab.distributed.mappings import (
    all_gather_single,
    gather_from_sequence_parallel_region,
    reduce_scatter_first_dim,
)
from megafab.distributed.masked_attention import apply_sink, attention, sink_grad, window_mask
from megafab.distributed.random import host_seed
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


def _chunks_in_order(x: torch.Tensor, dim: int, chunks, count: int) -> torch.Tensor:
    """x cut into `count` equal chunks along `dim`, the chunks `chunks` concatenated (views + one
    copy: no index tensor travels to the device)."""
    c = x.shape[dim] // count
    return torch.cat([x.narrow(dim, i * c, c) for i in chunks], dim=dim)


def split_for_context_parallel(x: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the whole sequence), concatenated."""
    if cp == 1:
        return x
    return _chunks_in_order(x, dim, chunk_ids(cp_rank, cp), 2 * cp)


@functools.cache
def _rank_layout_chunks(cp: int) -> tuple[int, ...]:
    """Chunk ids in the order the CP ranks' pieces concatenate: [0, 2cp-1, 1, 2cp-2, ...]."""
    return tuple(i for r in range(cp) for i in chunk_ids(r, cp))


def _to_natural_order(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Rank-ordered pieces (rank 0's s/cp tokens, rank 1's, ...) along `dim` -> sequence order."""
    layout = _rank_layout_chunks(cp)
    return _chunks_in_order(x, dim, [layout.index(j) for j in range(2 * cp)], 2 * cp)


def _to_rank_order(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    return _chunks_in_order(x, dim, _rank_layout_chunks(cp), 2 * cp)


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


def _start_kv_gather(kv: torch.Tensor, group):
    """Post the all-gather of every CP rank's kv [2, b, g, s/cp, d]; finish with _finish_kv_gather."""
    cp = dist.get_world_size(group)
    out = torch.empty((cp, *kv.shape), dtype=kv.dtype, device=kv.device)
    work = all_gather_single(out.view(cp * kv.shape[0], *kv.shape[1:]), kv.contiguous(), group=group,
                             async_op=True)
    return out, work, group


def _finish_kv_gather(pending) -> torch.Tensor:
    """The gathered K/V [2, b, g, s, d] in sequence order."""
    out, work, group = pending
    faults.wait(work, "K/V all-gather (context parallel)", group)
    cp, two, b, g, c2, d = out.shape
    gathered = out.permute(1, 2, 3, 0, 4, 5)  # [2, b, g, cp, s/cp, d]
    return _to_natural_order(gathered.reshape(two, b, g, cp * c2, d), 3, cp)


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


# ---- block plans (host-side, cached) -------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """Local query rows x rows of a key/value block; full or causal (square, on the diagonal).
    `first`: the first block of its rows, whose result is written rather than merged."""

    rows: slice
    keys: slice
    causal: bool
    first: bool


@functools.cache
def ring_plan(c: int, cp: int, rank: int) -> tuple[tuple[Block, ...], ...]:
    """Per ring step, the blocks of this rank's queries against the K/V of rank (rank - step) % cp.
    Blocks are full or causal (square, on the diagonal), never masked otherwise:

        step 0      all rows x all keys, causal
        src < rank  all rows x the first key chunk
        src > rank  the second query chunk x all keys"""
    steps = []
    for step in range(cp):
        src = (rank - step) % cp
        if step == 0:
            steps.append((Block(slice(0, 2 * c), slice(0, 2 * c), True, True),))
        elif src < rank:  # its first chunk lies before both of ours, its second after both
            steps.append((Block(slice(0, 2 * c), slice(0, c), False, False),))
        else:  # both its chunks lie after our first chunk and before our second
            steps.append((Block(slice(c, 2 * c), slice(0, 2 * c), False, False),))
    return tuple(steps)


@functools.cache
def allgather_plan(c: int, cp: int, rank: int) -> tuple[tuple[Block, ...], tuple[Block, ...]]:
    """(blocks against this rank's own K/V: each query chunk's causal diagonal, computed while the
    all-gather runs; blocks against the gathered K/V in sequence order: the keys before each chunk)."""
    local, gathered = [], []
    for a, chunk in enumerate(chunk_ids(rank, cp)):
        rows = slice(a * c, (a + 1) * c)
        local.append(Block(rows, rows, True, True))
        if chunk > 0:
            gathered.append(Block(rows, slice(0, chunk * c), False, False))
    return tuple(local), tuple(gathered)


# ---- attention variants --------------------------------------------------------------------------
def _forward_blocks(kernel, merge: LseMerge, q, kv, blocks, scale: float, first_id: int) -> list:
    """Attend q's rows to kv's rows block by block, merging into `merge`; the kernels' aux."""
    aux = []
    for i, blk in enumerate(blocks):
        out, lse, extra = kernel.forward(q[:, :, blk.rows], kv[0][:, :, blk.keys], kv[1][:, :, blk.keys],
                                         blk.causal, scale, first_id + i)
        merge.add(blk.rows, out, lse, blk.first)
        aux.append(extra)
    return aux


def _backward_blocks(ctx, saved, dout, dq, kv, dkv, blocks, first_id: int, aux) -> None:
    """Add the blocks' dq into dq and their dk, dv into dkv [2, b, g, sk, d]."""
    q, _, _, out, lse = saved
    for i, blk in enumerate(blocks):
        r, keys = blk.rows, blk.keys
        dq_b, dk_b, dv_b = ctx.kernel.backward(dout[:, :, r], q[:, :, r], kv[0][:, :, keys],
                                               kv[1][:, :, keys], out[:, :, r], lse[..., r], blk.causal,
                                               ctx.scale, first_id + i, aux[i])
        dq[:, :, r] += dq_b
        dkv[0][:, :, keys] += dk_b
        dkv[1][:, :, keys] += dv_b


def _start(ctx, q, group, dropout_p: float, seed: int, implementation: str, scale: float | None):
    """(cp, rank, chunk length c, merge) and the kernel and scale on ctx."""
    ctx.group = group
    ctx.kernel = block_kernel(q, dropout_p, seed, implementation)
    ctx.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return dist.get_world_size(group), dist.get_rank(group), q.shape[2] // 2, LseMerge(q)


def _save(ctx, q, k, v, merge: LseMerge, sink) -> torch.Tensor:
    """The merged output (with the sink's rescaling, masked_attention.apply_sink: the blocks'
    backward from out' and lse' is then the sink attention's) saved with flash attention's set."""
    ctx.sink = None if sink is None else sink.detach()
    if sink is not None:
        apply_sink(merge.out, merge.lse, ctx.sink)
    out = merge.out.to(q.dtype)  # [s, b, heads, d] memory: the caller's reshape to [s, b, h] is a view
    ctx.save_for_backward(q, k, v, out, merge.lse)
    return out


def _grads(ctx, saved, dkv, dout) -> tuple:
    """dk, dv, None for group .. scale, and the sink's gradient (masked_attention.sink_grad)."""
    dsink = None
    if ctx.sink is not None and ctx.needs_input_grad[8]:
        dsink = sink_grad(dout, saved[3], saved[4], ctx.sink)
    return dkv[0].to(saved[1].dtype), dkv[1].to(saved[2].dtype), None, None, None, None, None, dsink


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, dropout_p: float, seed: int, implementation: str, scale=None, sink=None):
        cp, r, c, merge = _start(ctx, q, group, dropout_p, seed, implementation, scale)
        ring, ctx.plan, ctx.aux = _Ring(group), ring_plan(c, cp, r), []
        kv = torch.stack([k, v])
        for step, blocks in enumerate(ctx.plan):
            pending = ring.start(kv, KV_TAG) if step < cp - 1 else None
            ctx.aux.append(_forward_blocks(ctx.kernel, merge, q, kv, blocks, ctx.scale, 4 * step))
            if pending is not None:
                kv = ring.finish(pending)
        return _save(ctx, q, k, v, merge, sink)

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors  # read once (recompute allows no more)
        q, k, v = saved[:3]
        ring, cp = _Ring(ctx.group), len(ctx.plan)
        dq = torch.zeros(q.shape, dtype=compute_dtype(q.dtype), device=q.device)
        kv, exchange = torch.stack([k, v]), None
        for step, blocks in enumerate(ctx.plan):
            pending = ring.start(kv, KV_TAG) if step < cp - 1 else None
            dkv = torch.zeros_like(kv, dtype=dq.dtype)
            _backward_blocks(ctx, saved, dout, dq, kv, dkv, blocks, 4 * step, ctx.aux[step])
            # dK/dV follow K/V round the ring: the partial sums of the ranks that held this block
            # before arrive while this block computes; ours leave while the next one does. After
            # the last step each rank holds its own, complete.
            if exchange is not None:
                dkv += ring.finish(exchange)
            exchange = ring.start(dkv, DKV_TAG) if cp > 1 else None
            if pending is not None:
                kv = ring.finish(pending)
        dkv = ring.finish(exchange) if exchange is not None else dkv
        return (dq.to(q.dtype), *_grads(ctx, saved, dkv, dout))


class _AllGatherAttention(torch.autograd.Function):
    """The diagonal blocks need only local K/V: they compute while the all-gather (forward) and
    the re-gather (backward) run; their dK/dV stay local, only the rest is reduce-scattered."""

    @staticmethod
    def forward(ctx, q, k, v, group, dropout_p: float, seed: int, implementation: str, scale=None, sink=None):
        cp, r, c, merge = _start(ctx, q, group, dropout_p, seed, implementation, scale)
        ctx.plan = local_blocks, gathered_blocks = allgather_plan(c, cp, r)
        kv = torch.stack([k, v])
        pending = _start_kv_gather(kv, group)
        ctx.aux = _forward_blocks(ctx.kernel, merge, q, kv, local_blocks, ctx.scale, 0)
        ctx.aux += _forward_blocks(ctx.kernel, merge, q, _finish_kv_gather(pending), gathered_blocks,
                                   ctx.scale, len(local_blocks))
        return _save(ctx, q, k, v, merge, sink)

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        local_blocks, gathered_blocks = ctx.plan
        n_local = len(local_blocks)
        dq = torch.zeros(q.shape, dtype=compute_dtype(q.dtype), device=q.device)
        kv = torch.stack([k, v])
        pending = _start_kv_gather(kv, ctx.group)  # gathered again, not saved
        dkv_local = torch.zeros_like(kv, dtype=dq.dtype)
        _backward_blocks(ctx, saved, dout, dq, kv, dkv_local, local_blocks, 0, ctx.aux[:n_local])
        kv = _finish_kv_gather(pending)
        dkv = torch.zeros_like(kv, dtype=dq.dtype)
        _backward_blocks(ctx, saved, dout, dq, kv, dkv, gathered_blocks, n_local, ctx.aux[n_local:])
        dkv_local += _reduce_scatter_kv(dkv, ctx.group)
        return (dq.to(q.dtype), *_grads(ctx, saved, dkv_local, dout))


def _sbhd_layout(x: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] stored as [s, b, heads, d], the layout SDPA's flash kernels return: the
    caller's permute-and-reshape to [s, b, h] is then a view, not a second saved copy."""
    return x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


def _ulysses_attention(q, k, v, group, dropout_p: float, scale: float | None = None,
                       window: int | None = None, sink: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """a2a: heads scattered, sequences gathered (in sequence order), causal SDPA (or the window's
    mask and the whole sequence's `mask`, this rank's heads' sinks: masked_attention.attention), and
    back."""
    cp = dist.get_world_size(group)

    def to_heads(x):  # [b, n, s/cp, d] -> [b, n/cp, s, d]
        return _to_natural_order(_AllToAll.apply(x, group, 1, 2), 2, cp)

    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    positions = torch.arange(q.shape[2], device=q.device)
    masked = None if window is None else window_mask(positions, positions, window)
    if mask is not None:
        masked = mask if masked is None else masked | mask
    sink = None if sink is None else sink.chunk(cp)[dist.get_rank(group)]
    out = attention(q, k, v, masked, sink, dropout_p, scale)  # K/V heads not repeated (GQA)
    return _sbhd_layout(_AllToAll.apply(_to_rank_order(out, 2, cp), group, 2, 1))


def _gathered_window_attention(q, k, v, group, dropout_p: float, scale: float | None, window: int | None,
                               sink: torch.Tensor | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """allgather with a window (or a mask): the whole sequence's K/V gathered (reduce-scattered back
    in backward), this rank's queries masked by their global positions (masked_attention.attention)
    and by their rows of the whole sequence's `mask`."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)  # [s/cp, 2, b, g, d]
    kv = _to_natural_order(gather_from_sequence_parallel_region(kv, group), 0, cp).permute(1, 2, 3, 0, 4)
    s = kv.shape[3]
    keys = torch.arange(s, device=q.device)
    rows = local_token_positions(s, rank, cp, q.device)
    masked = window_mask(rows, keys, window)
    if mask is not None:
        masked = masked | mask[..., rows, :]
    return attention(q, kv[0], kv[1], masked, sink, dropout_p, scale)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                               comm_type: str = "p2p", dropout_p: float = 0.0, seed: int | None = None,
                               implementation: str = "auto", scale: float | None = None,
                               window: int | None = None, sink: torch.Tensor | None = None,
                               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens against the whole sequence spread over `group`.

      p2p        ring: K/V blocks travel round the CP group (cp - 1 steps, the next block's transfer
                 overlapping the current block's compute); partial results merge by log-sum-exp.
                 Backward runs the ring again, dK/dV travelling with K/V back to their owner.
      allgather  K/V all-gathered (and re-gathered in backward, so only local K/V is saved) while
                 each query chunk's diagonal block computes on local K/V; dK/dV of the other
                 blocks reduce-scattered.
      a2a        an all-to-all trades the sequence split for a head split ([b, heads, s/cp, d] ->
                 [b, heads/cp, s, d]), plain SDPA runs on whole sequences, a second all-to-all
                 trades back; it saves what SDPA saves, the same bytes. Needs heads/TP and query
                 groups/TP divisible by cp.

    Dropout under p2p/allgather runs on the reference kernel with one seed per call from the host
    RNG tracker (the model-parallel stream, which differs across TP and CP ranks); each block's mask
    derives from it (BlockDropout), so backward and recompute see the same masks. Masks differ from
    a CP-1 run's (different blocks).

    q [b, heads, s/cp, d]; k, v [b, groups, s/cp, d] (GQA: not repeated); local token order as in
    the module docstring. Returns [b, heads, s/cp, d]. Dropout: p2p/allgather take `seed` (from
    random.host_seed(tracker); drawn from the CPU generator when None); a2a draws from the device
    stream it runs in. implementation "reference" forces blockwise_attention's kernel (tests,
    benchmarks). scale: the softmax scale (default 1/sqrt(d)).

    window (a sliding window's left size, masked_attention.window_mask): a2a masks its whole
    sequences, allgather masks its queries against the gathered K/V by their global positions
    (_gathered_window_attention); the p2p ring's blocks cannot be banded, so it refuses a window.
    sink [heads] (attention sinks): every comm type, exact (p2p/allgather rescale the merged output).
    mask [b|1, 1, s, s] (True: not allowed; e.g. --dataloader-inter-document-masking's documents): the
    whole sequence's, in sequence order; a2a and allgather mask as for a window, p2p refuses it.
    """
    if comm_type == "a2a":
        return _ulysses_attention(q, k, v, group, dropout_p, scale, window, sink, mask)
    if (window is not None or mask is not None) and comm_type == "allgather":
        return _gathered_window_attention(q, k, v, group, dropout_p, scale, window, sink, mask)
    if window is not None or mask is not None:
        raise ValueError(f"a sliding window or attention mask under CP comm type {comm_type!r}: use "
                         f"allgather or a2a")
    if dropout_p > 0 and seed is None:
        seed = host_seed(None)
    args = (q, k, v, group, dropout_p, seed or 0, implementation, scale, sink)
    if comm_type == "p2p":
        return _RingAttention.apply(*args)
    if comm_type == "allgather":
        return _AllGatherAttention.apply(*args)
    raise ValueError(f"unknown CP comm type {comm_type!r}; expected one of {', '.join(COMM_TYPES)}")
