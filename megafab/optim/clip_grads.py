"""Global gradient statistics over every shard of the model: L2 norm, zero count, inf/nan.

Each rank passes the gradients it *owns for counting* (see `counts_for_norm`) as `GradSet`s: grads
together with the groups whose ranks hold disjoint pieces of them; a set's local statistic is
summed (or max-ed) over its groups in turn, and the sets' results are added (or or-ed), as
megatron-core's ChainedOptimizer adds its dense and expert optimizers' squared norms.

  * Without the distributed optimizer DP replicas hold identical grads: dense grads reduce over
    the model-parallel group (TP x PP); expert grads, distinct on every expert-parallel rank and
    identical across expert-DP, over the expert model-parallel group (ETP x EP x PP). When the two
    groups are one (expert-parallel size 1, ETP = TP) the grads form one set.
  * With the distributed optimizer or FSDP2 every rank steps disjoint pieces of either kind (its
    DP shard of dense grads, its expert-DP shard of its EP rank's experts), so one set over
    DP x CP then TP x PP covers every rank of the world once (megatron-core's intra_dist_opt_group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megafab.distributed.data_parallel import is_expert_param


@dataclass
class GradSet:
    """Grads whose pieces on the ranks of `groups` are disjoint. `scaled` grads (offloaded
    entries', where backward left them: possibly 16-bit and loss-scaled) count as scale * g."""

    grads: list[torch.Tensor]
    groups: list
    scaled: list[torch.Tensor] = field(default_factory=list)


def counts_for_norm(param, topology) -> bool:
    """Whether this rank's copy of `param` enters the global norm (each value counted once).

    TP-sharded params count on every TP rank (disjoint shards); TP-replicated params only on TP rank
    0 (expert params: expert-TP rank 0); a tied embedding's second copy (last stage, PP > 1) does
    not count.
    """
    if topology is None:
        return True
    if is_expert_param(param):
        return getattr(param, "tensor_model_parallel", False) or topology.coord("etp") == 0
    if not getattr(param, "tensor_model_parallel", False) and topology.tp_rank != 0:
        return False
    if getattr(param, "shared_embedding", False) and topology.pp > 1 and not topology.is_first_stage:
        return False
    return True


def _all_reduce(value: torch.Tensor, groups, op=dist.ReduceOp.SUM) -> torch.Tensor:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(value, op=op, group=group)
    return value


def _squares(grads: list[torch.Tensor], scaled: list[torch.Tensor], scale: float, device) -> torch.Tensor:
    """sum(g^2) of this rank's grads (fp64: a rank may count no grads, and gloo needs one dtype);
    `scaled` grads' squares are summed in fp32 without a 16-bit intermediate."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += g.pow(2).sum(dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)
    for g in scaled:
        norm = torch.linalg.vector_norm(g, dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)
        total += norm.double().pow(2) * (scale * scale)
    return total


def global_grad_norm(sets: list[GradSet], device, scale: float = 1.0) -> float:
    """sqrt(sum over the sets of sum over all ranks in the set's groups of sum(g^2))."""
    total = 0.0
    for s in sets:
        total += float(_all_reduce(_squares(s.grads, s.scaled, scale, device), s.groups))
    return total ** 0.5


def clip_grads_by_norm(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale every grad by max_norm / total_norm when the norm exceeds max_norm (Megatron's 1e-6);
    returns the factor applied (1.0 when not clipped)."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return 1.0
    for g in grads:
        g.mul_(coeff)
    return coeff


def count_zeros(sets: list[GradSet], device) -> int:
    count = 0
    for s in sets:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g in s.grads + s.scaled:
            total += g.numel() - torch.count_nonzero(g)
        count += int(_all_reduce(total, s.groups).item())
    return count


def found_non_finite(sets: list[GradSet], device) -> bool:
    """True on every rank when any rank's grad (of any set) holds inf or nan."""
    found = False
    for s in sets:
        flag = torch.zeros((), dtype=torch.float32, device=device)
        if not all(bool(torch.isfinite(g).all()) for g in s.grads + s.scaled):
            flag.fill_(1.0)
        found |= bool(_all_reduce(flag, s.groups, op=dist.ReduceOp.MAX).item() > 0)
    return found
