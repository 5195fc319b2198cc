"""The training loop's part of mixture of experts, at the points Megatron does it:

- before backward (Megatron's forward_step): the balancing losses' backward weight, the grad
  scale x cp / micro-batches (MoEAuxLossAutoScaler.set_loss_scale); with --calculate-per-token-loss
  Megatron sets the grad scale and divides every gradient by the global batch's tokens, which here
  (gradients averaged over DP x CP) is the grad scale x dp x cp / tokens;
- after backward (Megatron's finalize_model_grads): the expert biases follow the step's tokens per
  expert, summed over TP x DP x CP (every rank of the stage), and global_aux_loss's counts restart;
- for the log: the balancing and z losses under Megatron's names (moe/loss_logging.py).
"""

from __future__ import annotations

from megafab.config.moe import moe_settings
from megafab.model.moe.balancing import LossScale, update_expert_biases
from megafab.model.moe.loss_logging import moe_loss_values
from megafab.model.moe.router import routers_of
from megafab.model.moe.settings import MoESettings


def moe_context_fields(cfg, topo) -> dict:
    """The LayerContext fields of an MoE model (none for a dense one): settings, groups, loss scale."""
    settings = moe_settings(cfg)
    if settings is None:
        return {}
    return dict(moe=settings, ep_group=topo.group("ep"), etp_group=topo.group("etp"),
                tp_ep_group=topo.group("etp", "ep"), tp_cp_group=topo.group("tp", "cp"),
                tp_dp_cp_group=topo.group("tp", "dp", "cp"),
                moe_loss_scale=LossScale(), calculate_per_token_loss=cfg.training.calculate_per_token_loss)


def balancing_loss_scale(grad_scale: float, topo, num_micro_batches: int,
                         global_tokens: float | None = None) -> float:
    """The attached losses' backward weight for this step; global_tokens: the loss tokens of the
    global batch with --calculate-per-token-loss (else None)."""
    if global_tokens is not None:
        return grad_scale * topo.dp * topo.cp / max(global_tokens, 1.0)
    return grad_scale * topo.cp / num_micro_batches


def set_balancing_loss_scale(models, value: float) -> None:
    """Every router of these chunks reads the one LossScale of the model; set it (or each one's)."""
    for scale in {id(r.loss_scale): r.loss_scale for r in routers_of(models)}.values():
        scale.set(value)


def after_backward(models, settings: MoESettings, topo) -> None:
    """Megatron's MoE steps of finalize_model_grads: expert-bias update, then the step state reset."""
    routers = routers_of(models)
    if settings.moe_router_enable_expert_bias:
        update_expert_biases(routers, settings.moe_router_bias_update_rate, topo.group("tp", "dp", "cp"))
    for router in routers:
        router.reset_step_state()


def num_moe_layers(settings: MoESettings, num_layers: int) -> int:
    return sum(settings.is_moe_layer(i) for i in range(num_layers))


def logged_balancing_losses(models, settings: MoESettings, cfg, topo, num_micro_batches: int) -> dict:
    """{Megatron's name: value} of this step on every rank (collective over each stage and PP)."""
    return moe_loss_values(settings, routers_of(models),
                           # Megatron counts each MTP layer as an MoE layer here (track_moe_metrics)
                           num_moe_layers=num_moe_layers(settings, cfg.model.num_layers)
                           + (cfg.model.mtp_num_layers or 0),
                           num_micro_batches=num_micro_batches, device=topo.device,
                           pp_group=topo.group("pp"), tp_cp_group=topo.group("tp", "cp"),
                           tp_dp_cp_group=topo.group("tp", "dp", "cp"), dp_group=topo.group("dp"),
                           per_layer=per_layer_logged(settings, cfg))


def per_layer_logged(settings: MoESettings, cfg) -> int | None:
    """--moe-per-layer-logging: the layers Megatron's per-layer log covers (the decoder's and the
    MTP block's), else None."""
    if not settings.moe_per_layer_logging:
        return None
    return cfg.model.num_layers + (getattr(cfg.model, "mtp_num_layers", None) or 0)

