"""--check-weight-hash-across-dp-replicas-interval: every data-parallel replica must hold the same
weights. At the start of training and after every N-th iteration each rank hashes each of its
parameters (SHA-1 of its bytes, as megatron-core's check_param_hashes_across_dp_replicas), gathers
the hashes over its replicas (DP x CP for dense parameters, expert-DP for routed experts) and
compares them with every replica's; a difference stops the job on every rank with one message
naming the parameters and ranks, as Megatron's assert does. Pending --overlap-param-gather gathers
land first (Megatron disables the forward pre-hooks for the check).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from megafab.distributed.data_parallel import is_expert_param
from megafab.errors import JobFault


class WeightHashMismatch(JobFault):
    """Replicas that should hold the same weights do not (every rank raises it alike)."""

    every_rank = True


def _hash(param: torch.Tensor) -> torch.Tensor:
    data = param.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
    return torch.frombuffer(bytearray(hashlib.sha1(data).digest()), dtype=torch.uint8)


def _mismatches(named: list[tuple[str, torch.Tensor]], group) -> list[str]:
    """'NAME (ranks R and S)' for each parameter whose hash differs between this rank and a replica."""
    if not named:
        return []
    local = torch.stack([_hash(p) for _, p in named])
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    me, ranks = dist.get_rank(), dist.get_process_group_ranks(group)
    return [f"{name} (ranks {min(me, ranks[r])} and {max(me, ranks[r])})"
            for r, other in enumerate(gathered) for i, (name, _) in enumerate(named)
            if not torch.equal(local[i], other[i])]


def check_weight_hashes(state) -> str:
    """Collective over the world; returns the line rank 0 prints when every replica agrees."""
    topo = state.topology
    for chunk in state.model:
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    named = [(f"chunk{i}.{n}" if len(state.model) > 1 else n, p) for i, chunk in enumerate(state.model)
             for n, p in getattr(chunk, "module", chunk).named_parameters()]
    bad = _mismatches([(n, p) for n, p in named if not is_expert_param(p)], topo.group("dp", "cp"))
    bad += _mismatches([(n, p) for n, p in named if is_expert_param(p)], topo.group("edp"))
    count = torch.tensor([len(bad)], dtype=torch.int64, device=topo.device)
    dist.all_reduce(count)
    if count.item():
        found = [None] * topo.world_size
        dist.all_gather_object(found, bad)
        listed = sorted({line for lines in found for line in lines})
        raise WeightHashMismatch(
            f"the weights of data-parallel replicas differ after iteration {state.iteration} "
            f"(--check-weight-hash-across-dp-replicas-interval): {'; '.join(listed[:8])}"
            f"{f' and {len(listed) - 8} more' if len(listed) > 8 else ''}; the replicas diverged (a "
            f"faulty device, a nondeterministic kernel or a bug); resume from the last checkpoint and "
            f"report it if it repeats")
    return f">>> Weight hashes match after {state.iteration} iterations..."
