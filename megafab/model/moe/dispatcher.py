"""Token dispatchers: bring each token to the ranks holding its experts, and the outputs back.

Both take this rank's tokens [N, h] with their routing (probs, routing_map [N, E]) and hand the
local experts their rows grouped by expert ([M, h], tokens per local expert, row probabilities);
`combine` returns the experts' rows as [N, h]. The expert-parallel group `ep_group` (None: EP 1,
no process group needed) splits the E experts into equal contiguous blocks, rank r holding
experts [r * E/ep, (r + 1) * E/ep).

    allgather  all-gather every rank's tokens and routing over EP, keep the rows of the local
               experts; combine scatters back into the gathered token order and reduce-scatters.
    alltoall   permute locally by expert, exchange only the routed rows (all-to-all with the
               per-rank counts), regroup by local expert; combine runs the same steps backwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megafab.distributed.mappings import (
    gather_first_dim,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
    reduce_scatter_to_sequence_parallel_region,
)
from megafab.model.moe.all_to_all import all_to_all
from megafab.model.moe.permutation import permute, sort_chunks, unpermute


@dataclass
class Dispatched:
    """What combine needs from dispatch."""

    row_token: torch.Tensor  # token index (in the dispatcher's token order) of each permuted row
    num_tokens: int  # tokens to restore (allgather: over the whole EP group)
    probs_dtype: torch.dtype
    counts: torch.Tensor | None = None  # alltoall at EP > 1: [ep, local experts] rows per rank/expert
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None


class TokenDispatcher:
    def __init__(self, num_experts: int, ep_group=None):
        self.ep_group = ep_group
        self.ep = group_size(ep_group)
        assert num_experts % self.ep == 0, (num_experts, self.ep)
        self.num_local_experts = num_experts // self.ep
        self.first_expert = group_rank(ep_group) * self.num_local_experts


class AllGatherDispatcher(TokenDispatcher):
    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        if self.ep > 1:
            with torch.no_grad():  # gloo has no bool collectives
                routing_map = gather_first_dim(routing_map.to(torch.uint8), self.ep_group).bool()
            probs = gather_from_sequence_parallel_region(probs, self.ep_group)  # [N * ep, E]
            hidden = gather_from_sequence_parallel_region(hidden, self.ep_group)  # [N * ep, h]
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        local_map = routing_map[:, local]
        rows, row_probs, row_token = permute(hidden, local_map, probs[:, local])
        tokens_per_expert = local_map.sum(dim=0).tolist()
        return rows, tokens_per_expert, row_probs, Dispatched(row_token, hidden.shape[0], probs.dtype)

    def combine(self, rows: torch.Tensor, state: Dispatched) -> torch.Tensor:
        out = unpermute(rows, state.row_token, state.num_tokens)
        if self.ep > 1:  # summed in the probabilities' dtype (fp32 / fp64 router), as megatron-core
            out = reduce_scatter_to_sequence_parallel_region(out.to(state.probs_dtype), self.ep_group)
            out = out.to(rows.dtype)
        return out


class AllToAllDispatcher(TokenDispatcher):
    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        counts = routing_map.sum(dim=0)  # [E] rows this rank sends to each expert
        rows, row_probs, row_token = permute(hidden, routing_map, probs)
        state = Dispatched(row_token, hidden.shape[0], probs.dtype)
        if self.ep == 1:
            return rows, counts.tolist(), row_probs, state
        local = self.num_local_experts
        with torch.no_grad():
            every_rank = gather_first_dim(counts[None], self.ep_group)  # [ep, E]
        state.counts = every_rank[:, self.first_expert:self.first_expert + local]  # [ep, local]
        state.input_splits = counts.view(self.ep, local).sum(dim=1).tolist()
        state.output_splits = state.counts.sum(dim=1).tolist()
        rows = all_to_all(rows, state.output_splits, state.input_splits, self.ep_group)
        row_probs = all_to_all(row_probs, state.output_splits, state.input_splits, self.ep_group)
        if local > 1:  # received rank-major (rank, expert); the experts want expert-major
            sizes = state.counts.flatten().tolist()
            order = [r * local + e for e in range(local) for r in range(self.ep)]
            rows, row_probs = sort_chunks(rows, sizes, order), sort_chunks(row_probs, sizes, order)
        return rows, state.counts.sum(dim=0).tolist(), row_probs, state

    def combine(self, rows: torch.Tensor, state: Dispatched) -> torch.Tensor:
        if self.ep > 1:
            local = self.num_local_experts
            if local > 1:
                sizes = state.counts.t().flatten().tolist()
                order = [e * self.ep + r for r in range(self.ep) for e in range(local)]
                rows = sort_chunks(rows, sizes, order)
            rows = all_to_all(rows, state.input_splits, state.output_splits, self.ep_group)
        return unpermute(rows, state.row_token, state.num_tokens)


DISPATCHERS = {"allgather": AllGatherDispatcher, "alltoall": AllToAllDispatcher}
