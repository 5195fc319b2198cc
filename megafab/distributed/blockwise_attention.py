"""Exact causal attention on one block of queries x keys, for the ring and all-gather variants of
context parallelism.

The forward returns, besides the output, the log-sum-exp of every query row's scores, so partial
results over disjoint key blocks merge exactly (`LseMerge`):

    lse = log(exp(lse_1) + exp(lse_2)),   out = exp(lse_1 - lse) * out_1 + exp(lse_2 - lse) * out_2

The backward is flash attention's: from the *merged* output and log-sum-exp each block recomputes
its probabilities p = exp(q k^T * scale - lse) and yields its share of dq, dk, dv, with
delta = rowsum(dout * out) standing in for the softmax's normalisation term. Both loop over tiles
of query rows, so no [sq, sk] tensor outlives one tile and nothing of that size is saved.

Shapes: q [b, g, hpg, sq, d] (query heads grouped by their key/value head, head = group * hpg + j
as repeat_interleave orders them), k and v [b, g, sk, d]. q_pos [sq] and k_pos [sk] are global token
positions: query i sees key j iff k_pos[j] <= q_pos[i]. Arithmetic runs in fp32 (fp64 for fp64
inputs).

Attention dropout: the keep-mask of a tile is drawn from a private generator seeded with
(seed, block id, tile), so backward regenerates exactly the forward's mask; the caller draws `seed`
once per attention call from its RNG stream (see context_parallel.py).
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
    """Attention dropout of probability p whose masks are reproducible per (block, tile)."""

    p: float
    seed: int

    def keep(self, block_id: int, tile: int, shape, device) -> torch.Tensor:
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed + _SEED_MIX * (block_id * 65_537 + tile)) % (1 << 63))
        return torch.rand(shape, generator=gen, device=device) >= self.p


def _tiles(q: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """(tile index, query rows, visible keys, whether a causal mask is needed) over tiles of query
    rows; keys after a tile's last query are never computed (k_pos ascending, as every caller's
    blocks are)."""
    b, g, hpg, sq, _ = q.shape
    q_pos, k_pos = q_pos.cpu(), k_pos.cpu()  # one device sync per block, none per tile
    rows = max(1, TILE_ELEMENTS // max(1, b * g * hpg * k_pos.numel()))
    for tile, start in enumerate(range(0, sq, rows)):
        tile_rows = slice(start, min(start + rows, sq))
        visible = int(torch.searchsorted(k_pos, q_pos[tile_rows].max(), right=True))
        yield tile, tile_rows, slice(0, visible), bool(k_pos[visible - 1] > q_pos[tile_rows].min())


def _probabilities(q_tile, k, q_pos_tile, k_pos, scale, masked: bool, lse_tile=None):
    """exp(q k^T * scale - lse) [b, g, hpg, t, sk], 0 where the key lies after the query; with
    lse_tile None the tile's own log-sum-exp is computed and returned too."""
    s = torch.matmul(q_tile, k.unsqueeze(2).transpose(-1, -2)).mul_(scale)
    if masked:
        s.masked_fill_(k_pos[None, :] > q_pos_tile[:, None], float("-inf"))
    if lse_tile is None:
        lse_tile = torch.logsumexp(s, dim=-1)
    return s.sub_(lse_tile[..., None]).exp_(), lse_tile


def block_forward(q, k, v, q_pos, k_pos, scale: float, dropout: BlockDropout | None = None,
                  block_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, g, hpg, sq, d], lse [b, g, hpg, sq]) in the compute dtype.

    Every query row must see at least one key (callers skip blocks that lie wholly in the future)."""
    acc = compute_dtype(q.dtype)
    k, v = k.to(acc), v.to(acc)
    out = q.new_empty(q.shape, dtype=acc)
    lse = q.new_empty(q.shape[:-1], dtype=acc)
    for tile, rows, keys, masked in _tiles(q, q_pos, k_pos):
        p, lse[..., rows] = _probabilities(q[..., rows, :].to(acc), k[:, :, keys], q_pos[rows],
                                           k_pos[keys], scale, masked)
        if dropout is not None:
            p.mul_(dropout.keep(block_id, tile, p.shape, p.device)).div_(1.0 - dropout.p)
        out[..., rows, :] = torch.matmul(p, v[:, :, keys].unsqueeze(2))
    return out, lse


def _sum_heads_of_group(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum over a group's hpg heads and the tile's rows of x^T y: [b, g, hpg, t, sk] x
    [b, g, hpg, t, d] -> [b, g, sk, d]."""
    if x.shape[2] == 1:
        return torch.matmul(x.squeeze(2).transpose(-1, -2), y.squeeze(2))
    return torch.einsum("bghts,bghtd->bgsd", x, y)


def block_backward(q, k, v, q_pos, k_pos, lse, dout, delta, scale: float,
                   dropout: BlockDropout | None = None, block_id: int = 0):
    """This block's (dq [b, g, hpg, sq, d], dk, dv [b, g, sk, d]) in the compute dtype, from the
    merged lse [b, g, hpg, sq], dout (compute dtype) and delta = rowsum(dout * out)."""
    acc = compute_dtype(q.dtype)
    k, v = k.to(acc), v.to(acc)
    dq = q.new_empty(q.shape, dtype=acc)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for tile, rows, keys, masked in _tiles(q, q_pos, k_pos):
        q_tile, dout_tile = q[..., rows, :].to(acc), dout[..., rows, :]
        k_tile, v_tile = k[:, :, keys], v[:, :, keys]
        p, _ = _probabilities(q_tile, k_tile, q_pos[rows], k_pos[keys], scale, masked, lse[..., rows])
        dp = torch.matmul(dout_tile, v_tile.unsqueeze(2).transpose(-1, -2))  # [b, g, hpg, t, sk]
        if dropout is not None:
            keep = dropout.keep(block_id, tile, p.shape, p.device).to(acc).div_(1.0 - dropout.p)
            dv[:, :, keys] += _sum_heads_of_group(p * keep, dout_tile)
            dp.mul_(keep)
        else:
            dv[:, :, keys] += _sum_heads_of_group(p, dout_tile)
        ds = dp.sub_(delta[..., rows, None]).mul_(p)  # p * (dp - delta)
        dq[..., rows, :] = torch.matmul(ds, k_tile.unsqueeze(2)).mul_(scale)
        dk[:, :, keys] += _sum_heads_of_group(ds, q_tile).mul_(scale)
    return dq, dk, dv


class LseMerge:
    """Running merge of partial attention results over disjoint key blocks, per query row."""

    def __init__(self, q: torch.Tensor):
        acc = compute_dtype(q.dtype)
        self.out = torch.zeros(q.shape, dtype=acc, device=q.device)
        self.lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        old = self.lse[..., rows]
        new = torch.logaddexp(old, lse)
        self.out[..., rows, :] = (self.out[..., rows, :] * torch.exp(old - new)[..., None]
                                  + out * torch.exp(lse - new)[..., None])
        self.lse[..., rows] = new
