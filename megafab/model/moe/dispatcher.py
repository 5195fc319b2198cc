"""Token dispatchers: bring each token to the ranks holding its experts, and the outputs back.

Both take this rank's tokens [N, h] with their routing (probs, routing_map [N, E]) and hand the
local experts their rows grouped by expert ([M, h], tokens per local expert, row probabilities);
`combine` returns the experts' rows as [N, h]. Every rank's N tokens are its own (under attention
TP the sequence-parallel [s/tp, b, h] slices; megatron-core requires SP for MoE with TP > 1).
Groups are megatron-core's (TokenDispatcher): ep_group splits the experts, etp_group shards each
expert, tp_ep_group is their product.

    allgather  all-gather every rank's tokens and routing over tp_ep, keep the local experts' rows;
               combine scatters back and reduce-scatters over tp_ep (summing the ETP partials).
    alltoall   permute locally by expert, exchange only the routed rows over EP, all-gather the
               ETP ranks' rows, regroup by local expert; combine runs the same steps backwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megafab.distributed.mappings import (
    all_to_all,
    gather_first_dim,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
    reduce_scatter_to_sequence_parallel_region,
)
from megafab.model.moe.permutation import fused_permute, fused_unpermute, permute, sort_chunks, unpermute


@dataclass
class Dispatched:
    """What combine needs from dispatch."""

    row_token: torch.Tensor  # token index (dispatcher's order) of each permuted row (fused: TE's row map)
    num_tokens: int  # tokens to restore (allgather: over the whole tp_ep group)
    probs_dtype: torch.dtype
    counts: torch.Tensor | None = None  # alltoall: [etp, ep, local experts] rows per source rank/expert
    input_splits: list[int] | None = None  # alltoall: rows sent to each EP rank
    output_splits: list[int] | None = None  # rows received from each EP rank
    etp_splits: list[int] | None = None  # rows gathered from each ETP rank


class TokenDispatcher:
    """The groups both dispatchers share (None: one rank, no process group needed):

        ep_group     splits the E experts into equal contiguous blocks, rank r holding experts
                     [r * E/ep, (r + 1) * E/ep)
        etp_group    expert tensor parallelism: the ranks sharing those experts, each holding a
                     shard of every local expert (experts.py); each computes partial outputs for
                     all their rows, summed by the reduce-scatter of combine
        tp_ep_group  the ETP x EP ranks (megatron's "expert tensor and model parallel" group);
                     needed only when both are > 1, else whichever of the two is > 1
    """

    def __init__(self, num_experts: int, ep_group=None, etp_group=None, tp_ep_group=None):
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep, self.etp = group_size(ep_group), group_size(etp_group)
        assert num_experts % self.ep == 0, (num_experts, self.ep)
        if tp_ep_group is None:
            assert self.ep == 1 or self.etp == 1, "EP and ETP > 1 need the tp_ep group"
            tp_ep_group = ep_group if self.etp == 1 else etp_group
        assert group_size(tp_ep_group) == self.ep * self.etp, (group_size(tp_ep_group), self.ep, self.etp)
        self.tp_ep_group = tp_ep_group
        self.num_local_experts = num_experts // self.ep
        self.first_expert = group_rank(ep_group) * self.num_local_experts
        self.permute_fusion = False  # Transformer Engine's fused permutation (MoELayer sets it)

    def _permute(self, tokens, routing_map, probs):
        return (fused_permute if self.permute_fusion else permute)(tokens, routing_map, probs)

    def _unpermute(self, rows, state):
        restore = fused_unpermute if self.permute_fusion else unpermute
        return restore(rows, state.row_token, state.num_tokens)


class AllGatherDispatcher(TokenDispatcher):
    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        if self.ep * self.etp > 1:
            group = self.tp_ep_group
            with torch.no_grad():  # gloo has no bool collectives
                routing_map = gather_first_dim(routing_map.to(torch.uint8), group).bool()
            probs = gather_from_sequence_parallel_region(probs, group)  # [N * ep * etp, E]
            hidden = gather_from_sequence_parallel_region(hidden, group)  # [N * ep * etp, h]
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        local_map = routing_map[:, local]
        rows, row_probs, row_token = self._permute(hidden, local_map, probs[:, local])
        tokens_per_expert = local_map.sum(dim=0).tolist()
        return rows, tokens_per_expert, row_probs, Dispatched(row_token, hidden.shape[0], probs.dtype)

    def combine(self, rows: torch.Tensor, state: Dispatched) -> torch.Tensor:
        out = self._unpermute(rows, state)
        if self.ep * self.etp > 1:  # summed in the probabilities' dtype (fp32/fp64 router), as megatron-core
            out = reduce_scatter_to_sequence_parallel_region(out.to(state.probs_dtype), self.tp_ep_group)
            out = out.to(rows.dtype)
        return out


class AllToAllDispatcher(TokenDispatcher):
    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        counts = routing_map.sum(dim=0)  # [E] rows this rank sends to each expert
        rows, row_probs, row_token = self._permute(hidden, routing_map, probs)
        state = Dispatched(row_token, hidden.shape[0], probs.dtype)
        if self.ep * self.etp == 1:
            return rows, counts.tolist(), row_probs, state
        local = self.num_local_experts
        state.counts = self._source_counts(counts)  # [etp, ep, local]
        state.input_splits = counts.view(self.ep, local).sum(dim=1).tolist()
        state.output_splits = state.counts[group_rank(self.etp_group)].sum(dim=1).tolist()
        state.etp_splits = state.counts.sum(dim=(1, 2)).tolist()
        rows = all_to_all(rows, state.output_splits, state.input_splits, self.ep_group)
        row_probs = all_to_all(row_probs, state.output_splits, state.input_splits, self.ep_group)
        rows = gather_from_sequence_parallel_region(rows, self.etp_group, output_split_sizes=state.etp_splits)
        row_probs = gather_from_sequence_parallel_region(row_probs, self.etp_group,
                                                         output_split_sizes=state.etp_splits)
        if local > 1:  # received source-major (etp rank, ep rank, expert); the experts want expert-major
            sources = self.etp * self.ep
            sizes = state.counts.flatten().tolist()
            order = [s * local + e for e in range(local) for s in range(sources)]
            rows, row_probs = sort_chunks(rows, sizes, order), sort_chunks(row_probs, sizes, order)
        return rows, state.counts.sum(dim=(0, 1)).tolist(), row_probs, state

    def _source_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[E] rows of this rank per expert -> [etp, ep, local]: the rows every rank of this rank's
        tp_ep block sends to each local expert."""
        with torch.no_grad():
            every = counts[None]
            if self.ep > 1:
                every = gather_first_dim(every, self.ep_group)  # [ep, E]
            every = every[None]
            if self.etp > 1:
                every = gather_first_dim(every, self.etp_group)  # [etp, ep, E]
        return every[:, :, self.first_expert:self.first_expert + self.num_local_experts]

    def combine(self, rows: torch.Tensor, state: Dispatched) -> torch.Tensor:
        if self.ep * self.etp > 1:
            local, sources = self.num_local_experts, self.etp * self.ep
            if local > 1:
                sizes = state.counts.permute(2, 0, 1).flatten().tolist()  # expert-major
                order = [e * sources + s for s in range(sources) for e in range(local)]
                rows = sort_chunks(rows, sizes, order)
            if self.etp > 1:  # sums the ETP ranks' partial outputs, in the probabilities' dtype
                summed = reduce_scatter_to_sequence_parallel_region(
                    rows.to(state.probs_dtype), self.etp_group, input_split_sizes=state.etp_splits)
                rows = summed.to(rows.dtype)
            rows = all_to_all(rows, state.input_splits, state.output_splits, self.ep_group)
        return self._unpermute(rows, state)


DISPATCHERS = {"allgather": AllGatherDispatcher, "alltoall": AllToAllDispatcher}
