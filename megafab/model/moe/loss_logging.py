"""The balancing and z losses for the iteration log, reduced across ranks as Megatron's
track_moe_metrics reduces them, under its names (load_balancing_loss, seq_load_balancing_loss,
global_load_balancing_loss, z_loss).

Each router logs loss / coeff per forward. For the log line: summed over this stage's MoE layers
and the step's micro-batches, summed over the pipeline stages, then
    aux_loss, seq_aux_loss   summed over tp_cp (each rank logged its share), averaged over DP
    global_aux_loss          summed over tp_dp_cp (its share is of the global batch)
    z_loss                   not reduced further (Megatron logs the last rank's own value)
and divided by the micro-batches and the number of MoE layers of the model. Every rank of a
pipeline stage calls this with the same names, also a stage without MoE layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megafab.distributed.mappings import group_size
from megafab.model.moe.router import LOGGED_LOSSES
from megafab.model.moe.settings import MoESettings


def logged_loss_names(settings: MoESettings) -> list[str]:
    names = [name for kind, name in LOGGED_LOSSES.items() if settings.aux_loss_coeff(kind) > 0]
    return names + (["z_loss"] if settings.moe_z_loss_coeff is not None else [])


def moe_loss_values(settings: MoESettings, routers, *, num_moe_layers: int, num_micro_batches: int,
                    device=None, pp_group=None, tp_cp_group=None, tp_dp_cp_group=None,
                    dp_group=None) -> dict[str, float]:
    """{Megatron's name: value for the log} for this step; the routers' logs start over."""
    names = logged_loss_names(settings)
    totals = torch.zeros(len(names), dtype=torch.float64, device=device)
    for router in routers:
        for i, name in enumerate(names):
            if name in router.logged_losses:
                totals[i] += router.logged_losses[name].to(totals)
        router.logged_losses.clear()
    values = {}
    for i, name in enumerate(names):
        total = totals[i:i + 1].clone()
        _sum(total, pp_group)
        if name == "global_load_balancing_loss":
            _sum(total, tp_dp_cp_group)
        elif name != "z_loss":
            _sum(total, tp_cp_group)
            _sum(total, dp_group)
            total /= group_size(dp_group)
        values[name] = total.item() / num_micro_batches / num_moe_layers
    return values


def _sum(tensor: torch.Tensor, group) -> None:
    if group_size(group) > 1:
        dist.all_reduce(tensor, group=group)
