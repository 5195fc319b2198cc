"""Global gradient statistics over every shard of the model: L2 norm, zero count, inf/nan.

Each rank passes the gradients it *owns for counting* (see `counts_for_norm`) and the groups whose
ranks hold disjoint pieces; the local statistic is summed (or max-ed) over those groups in turn.
Without the distributed optimizer DP replicas hold identical grads, so the groups are the
model-parallel group (TP x PP); with it each DP rank holds a disjoint shard, so DP is added.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def counts_for_norm(param, topology) -> bool:
    """Whether this rank's copy of `param` enters the global norm (each value counted once).

    TP-sharded params count on every TP rank (disjoint shards); TP-replicated params only on TP rank
    0; a tied embedding's second copy (last stage, PP > 1) does not count.
    """
    if topology is None:
        return True
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


def global_grad_norm(grads: list[torch.Tensor], groups, device, scaled: list[torch.Tensor] = (),
                     scale: float = 1.0) -> float:
    """sqrt(sum over all ranks in `groups` of sum(g^2)) for this rank's counted grads; `scaled`
    grads (offloaded entries', possibly 16-bit and loss-scaled) count as `scale` * g, their
    squares summed in fp32 without a 16-bit intermediate."""
    # The running sum is fp64 on every rank (a rank may count no grads, and gloo needs one dtype).
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += g.pow(2).sum(dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)
    for g in scaled:
        norm = torch.linalg.vector_norm(g, dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)
        total += norm.double().pow(2) * (scale * scale)
    return float(_all_reduce(total, groups).sqrt())


def clip_grads_by_norm(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale every grad by max_norm / total_norm when the norm exceeds max_norm (Megatron's 1e-6);
    returns the factor applied (1.0 when not clipped)."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return 1.0
    for g in grads:
        g.mul_(coeff)
    return coeff


def count_zeros(grads: list[torch.Tensor], groups, device) -> int:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += g.numel() - torch.count_nonzero(g)
    return int(_all_reduce(total, groups).item())


def found_non_finite(grads: list[torch.Tensor], groups, device) -> bool:
    """True on every rank when any rank's grad holds inf or nan."""
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if not torch.isfinite(g).all():
            flag.fill_(1.0)
            break
    return bool(_all_reduce(flag, groups, op=dist.ReduceOp.MAX).item() > 0)
