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

TILE_ELEMENTS = 1 << 23  # scores per query tile (32 MiB in fp32), bounds the transient memory
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


def _tiles(q: torch.Tensor, sk: int):
    b, g, hpg, sq, _ = q.shape
    rows = max(1, TILE_ELEMENTS // max(1, b * g * hpg * sk))
    for tile, start in enumerate(range(0, sq, rows)):
        yield tile, slice(start, min(start + rows, sq))


def _scores(q_tile, k, q_pos_tile, k_pos, scale):
    """[b, g, hpg, t, sk] scaled scores, -inf where the key lies after the query."""
    s = torch.matmul(q_tile, k.unsqueeze(2).transpose(-1, -2)) * scale
    if k_pos.max() > q_pos_tile.min():
        s = s.masked_fill(k_pos[None, :] > q_pos_tile[:, None], float("-inf"))
    return s


def block_forward(q, k, v, q_pos, k_pos, scale: float, dropout: BlockDropout | None = None,
                  block_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, g, hpg, sq, d], lse [b, g, hpg, sq]) in the compute dtype.

    Every query row must see at least one key (callers skip blocks that lie wholly in the future)."""
    acc = compute_dtype(q.dtype)
    k, v = k.to(acc), v.to(acc)
    out = q.new_empty(q.shape, dtype=acc)
    lse = q.new_empty(q.shape[:-1], dtype=acc)
    for tile, rows in _tiles(q, k.shape[-2]):
        s = _scores(q[..., rows, :].to(acc), k, q_pos[rows], k_pos, scale)
        lse[..., rows] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., rows, None])
        if dropout is not None:
            p = p * dropout.keep(block_id, tile, p.shape, p.device) / (1.0 - dropout.p)
        out[..., rows, :] = torch.matmul(p, v.unsqueeze(2))
    return out, lse


def block_backward(q, k, v, q_pos, k_pos, lse, dout, delta, scale: float,
                   dropout: BlockDropout | None = None, block_id: int = 0):
    """This block's (dq [b, g, hpg, sq, d], dk, dv [b, g, sk, d]) in the compute dtype, from the
    merged lse [b, g, hpg, sq], dout (compute dtype) and delta = rowsum(dout * out)."""
    acc = compute_dtype(q.dtype)
    k, v = k.to(acc), v.to(acc)
    dq = q.new_empty(q.shape, dtype=acc)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for tile, rows in _tiles(q, k.shape[-2]):
        q_tile, dout_tile = q[..., rows, :].to(acc), dout[..., rows, :]
        p = torch.exp(_scores(q_tile, k, q_pos[rows], k_pos, scale) - lse[..., rows, None])
        dp = torch.matmul(dout_tile, v.unsqueeze(2).transpose(-1, -2))  # [b, g, hpg, t, sk]
        if dropout is not None:
            keep = dropout.keep(block_id, tile, p.shape, p.device).to(acc) / (1.0 - dropout.p)
            dv += torch.einsum("bghts,bghtd->bgsd", p * keep, dout_tile)
            dp = dp * keep
        else:
            dv += torch.einsum("bghts,bghtd->bgsd", p, dout_tile)
        ds = p * (dp - delta[..., rows, None])
        dq[..., rows, :] = torch.matmul(ds, k.unsqueeze(2)) * scale
        dk += torch.einsum("bghts,bghtd->bgsd", ds, q_tile) * scale
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
