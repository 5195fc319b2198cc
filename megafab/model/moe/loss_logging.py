"""The balancing and z losses for the iteration log, reduced across ranks as Megatron's
track_moe_metrics reduces them, under its names (load_balancing_loss, seq_load_balancing_loss,
global_load_balancing_loss, z_loss).

Each router logs loss / coeff per forward. For the log line: summed over this stage's MoE layers
and the step's micro-batches, summed over the pipeline stages, then
    aux_loss, seq_aux_loss   summed over tp_cp (each rank logged its share), averaged over DP
    global_aux_loss          summed over tp_dp_cp (its share is of the global batch)
    z_loss                   not reduced further (Megatron logs the last rank's own value)
and divided by the micro-batches and the number of MoE layers of the model (per layer: by the
micro-batches). Every rank of a pipeline stage calls this with the same names, also a stage
without MoE layers.
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
                    dp_group=None, per_layer: int | None = None) -> dict[str, float]:
    """{Megatron's name: value for the log} for this step; the routers' logs start over.

    per_layer (--moe-per-layer-logging: the number of layers, MTP layers included) adds each
    layer's value, reduced alike, as `moe/<name>_layer_<i>` (TensorBoard only, as Megatron's
    track_moe_metrics; i over every layer, a dense one's 0, an MTP layer's after the decoder's)."""
    names = logged_loss_names(settings)
    width = per_layer or 1
    totals = torch.zeros(len(names), width, dtype=torch.float64, device=device)
    for router in routers:
        layer = router.log_layer if per_layer and router.log_layer is not None else 0
        for i, name in enumerate(names):
            if name in router.logged_losses:
                totals[i, layer] += router.logged_losses[name].to(totals)
        router.logged_losses.clear()
    values, layers = {}, {}
    for i, name in enumerate(names):
        total = totals[i].clone()
        _sum(total, pp_group)
        if name == "global_load_balancing_loss":
            _sum(total, tp_dp_cp_group)
        elif name != "z_loss":
            _sum(total, tp_cp_group)
            _sum(total, dp_group)
            total /= group_size(dp_group)
        values[name] = total.sum().item() / num_micro_batches / num_moe_layers
        if per_layer:
            layers.update({f"moe/{name}_layer_{j}": v / num_micro_batches
                           for j, v in enumerate(total.tolist())})
    return {**values, **layers}


def _sum(tensor: torch.Tensor, group) -> None:
    if group_size(group) > 1:
        dist.all_reduce(tensor, group=group)
