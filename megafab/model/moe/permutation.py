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


def sort_chunks(rows: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """rows split into chunks of `sizes`, concatenated again in `order`."""
    chunks = torch.split(rows, sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)
