"""Token permutation: group tokens by expert, and scatter expert outputs back to their tokens.

    permute    tokens [N, h], routing_map [N, E] -> [sum(map), h]: expert 0's tokens (ascending
               token order), then expert 1's, ...; plus the token index of each row
    unpermute  rows [sum(map), h] -> [N, h], each token the sum of its rows

A token routed to k experts appears k times; the expert outputs are already weighted by the
routing probabilities (the experts apply them), so unpermute only adds.
"""

from __future__ import annotations

import torch


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None):
    """-> (rows [sum(map), h], row probabilities or None, token index of each row)."""
    expert_major = routing_map.t()  # [E, N]
    token_ids = torch.arange(routing_map.shape[0], device=routing_map.device).expand_as(expert_major)
    row_token = token_ids.masked_select(expert_major)
    row_probs = None if probs is None else probs.t().masked_select(expert_major)
    return tokens.index_select(0, row_token), row_probs, row_token


def unpermute(rows: torch.Tensor, row_token: torch.Tensor, num_tokens: int) -> torch.Tensor:
    out = torch.zeros(num_tokens, rows.shape[-1], dtype=rows.dtype, device=rows.device)
    return out.index_add(0, row_token, rows)


def fused_permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None):
    """permute through Transformer Engine's fused kernels (--moe-permute-fusion, TE layers): the same
    rows in the same order; the row map is TE's row_id_map (give it to fused_unpermute)."""
    import transformer_engine.pytorch as te  # deferred: GPU-only optional package

    num_out = int(routing_map.sum())
    if probs is None:
        rows, row_map = te.moe_permute(tokens, routing_map, num_out_tokens=num_out, map_type="mask")
        return rows, None, row_map
    return te.moe_permute_with_probs(tokens, probs, routing_map, num_out_tokens=num_out)


def fused_unpermute(rows: torch.Tensor, row_map: torch.Tensor, num_tokens: int) -> torch.Tensor:
    import transformer_engine.pytorch as te  # deferred: GPU-only optional package

    return te.moe_unpermute(rows, row_map, restore_shape=torch.Size([num_tokens, rows.shape[-1]]),
                            map_type="mask")


def sort_chunks(rows: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """rows split into chunks of `sizes`, concatenated again in `order`."""
    chunks = torch.split(rows, sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)
