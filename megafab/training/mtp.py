"""The training loop's part of multi-token prediction, at the points Megatron does it:

- before backward (Megatron's forward_step_calc_loss): the MTP losses' backward weight,
  MTPLossAutoScaler.set_loss_scale(grad scale / micro-batches), or with --calculate-per-token-loss
  the grad scale, where Megatron later divides every gradient by the global batch's tokens: here
  (gradients averaged over DP x CP) the grad scale x dp x cp / tokens;
- for the log (Megatron's MTPLossLoggingHelper.track_mtp_metrics): each depth's loss summed over
  the step's micro-batches, averaged over DP x CP, divided by the micro-batches, as `mtp_<k> loss`
  (Megatron's names; the pipeline's last stage holds them, and its last rank prints the line).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megafab.distributed.mappings import group_size


def mtp_blocks(models) -> list:
    """The MTP blocks of these model chunks (DDP / FSDP2 wrapped or not): the last stage's last chunk."""
    out = []
    for chunk in models:
        block = getattr(getattr(chunk, "module", chunk), "mtp", None)
        if block is not None:
            out.append(block)
    return out


def mtp_loss_scale(grad_scale: float, topo, num_micro_batches: int,
                   global_tokens: float | None = None) -> float:
    """The MTP losses' backward weight for this step; global_tokens: the loss tokens of the global
    batch with --calculate-per-token-loss (else None)."""
    if global_tokens is not None:
        return grad_scale * topo.dp * topo.cp / max(global_tokens, 1.0)
    return grad_scale / num_micro_batches


def set_mtp_loss_scale(models, value: float) -> None:
    for block in mtp_blocks(models):
        block.loss_scale.set(value)


def logged_mtp_losses(models, topo, num_micro_batches: int) -> dict[str, float]:
    """{"mtp_1 loss": ..., ...} on the ranks of the last pipeline stage (collective over its DP x CP
    group), {} elsewhere."""
    values = [v for v in (block.take_logged_losses() for block in mtp_blocks(models)) if v is not None]
    if not values:
        return {}
    total = torch.stack(values).sum(dim=0).to(topo.device)
    group = topo.group("dp", "cp")
    if group_size(group) > 1:
        dist.all_reduce(total, group=group)
        total /= group_size(group)
    return {f"mtp_{k + 1} loss": v / num_micro_batches for k, v in enumerate(total.tolist())}
