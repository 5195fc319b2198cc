"""Exact attention on one block of queries x keys in plain PyTorch: the portable reference the fused
kernels (fused_attention.py) are tested against, and the kernel wherever none of them applies
(attention dropout, float64 on CUDA, devices without a flash kernel).

A block is either full (every query sees every key) or causal: square, query i sees key j iff
j <= i (the fused kernels' top-left convention; with ReferenceKernel's sliding `window` also
j >= i - window). The forward also returns each query row's log-sum-exp, so partial results over
disjoint key blocks merge exactly (LseMerge):

    lse = log(exp(lse_1) + exp(lse_2)),   out = exp(lse_1 - lse) * out_1 + exp(lse_2 - lse) * out_2

The backward is flash attention's (ReferenceKernel.backward). Shapes: q [b, heads, sq, d], k and v
[b, groups, sk, d] (GQA: query head = group * hpg + j, as repeat_interleave orders them), lse
[b, heads, sq]. Arithmetic runs in fp32 (fp64 for fp64 inputs); no host-device synchronization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE_ELEMENTS = 1 << 21  # scores per query tile (8 MiB in fp32), bounds the transient memory
_SEED_MIX = 1_000_003


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class BlockDropout:
    """Attention dropout of probability p whose masks are reproducible per (block, tile): a tile's
    keep-mask is drawn from a private generator seeded with (seed, block id, tile), so backward
    regenerates exactly the forward's mask. The caller passes `seed`, drawn once per attention call
    from the host RNG tracker (context_parallel.py)."""

    p: float
    seed: int

    def keep(self, block_id: int, tile: int, shape, device) -> torch.Tensor:
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed + _SEED_MIX * (block_id * 65_537 + tile)) % (1 << 63))
        return torch.rand(shape, generator=gen, device=device) >= self.p


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, ...] -> [b, groups, heads/groups, ...] (a view)."""
    return x.unflatten(1, (groups, -1))


def window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, left: int | None) -> torch.Tensor:
    """[sq, sk] bool, True where attention is NOT allowed (Megatron's mask): a key after the query,
    or (left not None and >= 0) more than `left` positions before it."""
    distance = q_positions[:, None] - k_positions[None, :]  # query position - key position
    masked = distance < 0
    if left is not None and left >= 0:
        masked |= distance > left
    return masked


def _tiles(q_shape, sk: int, causal: bool, window: int | None = None):
    """(tile index, query rows, visible keys, first masked key offset or None) over tiles of query
    rows; under a causal block keys after a tile's last query (and, with a window, keys more than
    `window` before its first query) are never computed."""
    b, h, sq, _ = q_shape
    assert not causal or sq == sk, "a causal block is square"
    assert window is None or causal, "a window applies to causal blocks"
    rows = max(1, TILE_ELEMENTS // max(1, b * h * sk))
    for tile, start in enumerate(range(0, sq, rows)):
        end = min(start + rows, sq)
        first = 0 if window is None else max(0, start - window)
        yield tile, slice(start, end), slice(first, end if causal else sk), start if causal else None


def _probabilities(q_tile, k, scale, mask_from: int | None, lse_tile=None, keys_from: int = 0,
                   window: int | None = None):
    """exp(q k^T * scale - lse) [b, g, hpg, t, sk], 0 above the causal diagonal (row i of the tile
    is query mask_from + i, column j key keys_from + j) and, with a window, more than `window` keys
    back; with lse_tile None the tile's own log-sum-exp is computed too."""
    s = torch.matmul(q_tile, k.unsqueeze(2).transpose(-1, -2)).mul_(scale)
    if mask_from is not None:
        t, sk = s.shape[-2:]
        masked = window_mask(torch.arange(mask_from, mask_from + t, device=s.device),
                             torch.arange(keys_from, keys_from + sk, device=s.device), window)
        s.masked_fill_(masked, float("-inf"))
    if lse_tile is None:
        lse_tile = torch.logsumexp(s, dim=-1)
    return s.sub_(lse_tile[..., None]).exp_(), lse_tile


class ReferenceKernel:
    """Block forward/backward in plain PyTorch, with optional BlockDropout and a sliding window on
    causal blocks (same interface as fused_attention's kernels; `aux` is unused)."""

    def __init__(self, dropout: BlockDropout | None = None, window: int | None = None):
        self.dropout, self.window = dropout, window

    def forward(self, q, k, v, causal: bool, scale: float, block_id: int = 0):
        """(out [b, heads, sq, d], lse [b, heads, sq], aux) in the compute dtype."""
        acc = compute_dtype(q.dtype)
        g = k.shape[1]
        k, v = k.to(acc), v.to(acc)
        qg = _grouped(q, g)
        out = q.new_empty(qg.shape, dtype=acc)
        lse = q.new_empty(qg.shape[:-1], dtype=acc)
        for tile, rows, keys, mask_from in _tiles(q.shape, k.shape[2], causal, self.window):
            p, lse[..., rows] = _probabilities(qg[..., rows, :].to(acc), k[:, :, keys], scale, mask_from,
                                               keys_from=keys.start, window=self.window)
            if self.dropout is not None:
                p.mul_(self.dropout.keep(block_id, tile, p.shape, p.device)).div_(1.0 - self.dropout.p)
            out[..., rows, :] = torch.matmul(p, v[:, :, keys].unsqueeze(2))
        return out.flatten(1, 2), lse.flatten(1, 2), None

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, block_id: int = 0, aux=None):
        """This block's (dq [b, heads, sq, d], dk, dv [b, groups, sk, d]) in the compute dtype, from
        the merged out and lse [b, heads, sq].

        Flash attention's backward: from the *merged* output and log-sum-exp the block recomputes
        its probabilities p = exp(q k^T * scale - lse) and yields its share of dq, dk, dv, with
        delta = rowsum(dout * out) standing in for the softmax's normalisation term. Forward and
        backward loop over tiles of query rows, so no [sq, sk] tensor outlives one tile and nothing
        of that size is saved; tiles and masks are planned from shapes alone."""
        acc = compute_dtype(q.dtype)
        g = k.shape[1]
        k, v = k.to(acc), v.to(acc)
        qg, dout = _grouped(q, g), _grouped(dout, g).to(acc)
        delta = (dout * _grouped(out, g).to(acc)).sum(-1)  # rowsum(dout * out)
        lse = _grouped(lse, g)
        dq = q.new_empty(qg.shape, dtype=acc)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for tile, rows, keys, mask_from in _tiles(q.shape, k.shape[2], causal, self.window):
            q_tile, dout_tile = qg[..., rows, :].to(acc), dout[..., rows, :]
            k_tile, v_tile = k[:, :, keys], v[:, :, keys]
            p, _ = _probabilities(q_tile, k_tile, scale, mask_from, lse[..., rows], keys.start, self.window)
            dp = torch.matmul(dout_tile, v_tile.unsqueeze(2).transpose(-1, -2))  # [b, g, hpg, t, sk]
            if self.dropout is not None:
                keep = self.dropout.keep(block_id, tile, p.shape, p.device).to(acc).div_(1.0 - self.dropout.p)
                dv[:, :, keys] += _sum_heads_of_group(p * keep, dout_tile)
                dp.mul_(keep)
            else:
                dv[:, :, keys] += _sum_heads_of_group(p, dout_tile)
            ds = dp.sub_(delta[..., rows, None]).mul_(p)  # p * (dp - delta)
            dq[..., rows, :] = torch.matmul(ds, k_tile.unsqueeze(2)).mul_(scale)
            dk[:, :, keys] += _sum_heads_of_group(ds, q_tile).mul_(scale)
        return dq.flatten(1, 2), dk, dv


def _sum_heads_of_group(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum over a group's hpg heads and the tile's rows of x^T y: [b, g, hpg, t, sk] x
    [b, g, hpg, t, d] -> [b, g, sk, d]."""
    if x.shape[2] == 1:
        return torch.matmul(x.squeeze(2).transpose(-1, -2), y.squeeze(2))
    return torch.einsum("bghts,bghtd->bgsd", x, y)


class LseMerge:
    """Running merge of partial attention results over disjoint key blocks, per query row.

    `out` is kept in [s, b, heads, d] memory (viewed as [b, heads, s, d]), the layout the caller's
    permute to [s, b, h] reads as a view. The first block of a row range is written, not merged."""

    def __init__(self, q: torch.Tensor):
        acc = compute_dtype(q.dtype)
        b, h, s, d = q.shape
        self.out = torch.empty(s, b, h, d, dtype=acc, device=q.device).permute(1, 2, 0, 3)
        self.lse = torch.empty(b, h, s, dtype=acc, device=q.device)

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor, first: bool) -> None:
        if first:
            self.out[..., rows, :] = out
            self.lse[..., rows] = lse
            return
        old = self.lse[..., rows]
        new = torch.logaddexp(old, lse)
        self.out[..., rows, :] = (self.out[..., rows, :] * torch.exp(old - new)[..., None]
                                  + out * torch.exp(lse - new)[..., None])
        self.lse[..., rows] = new
