"""MoELayer: the MLP of an MoE transformer layer (megatron-core 0.16.1's MoELayer).

    [s, b, h] -> router (probs, routing_map over s*b tokens) -> dispatcher (rows per local expert)
              -> experts -> dispatcher.combine -> [s, b, h] (+ shared experts) ; returns (out, None)

Parameter names are megatron-core's: router.weight (router.expert_bias buffer),
experts.local_experts.{i}.linear_fc1.weight (sequential) or experts.linear_fc1.weight
[E_local, ...] (grouped), shared_experts.linear_fc1.weight, shared_experts.gate_weight.
"""

from __future__ import annotations

import torch
from torch import nn

from megafab.distributed.mappings import group_rank
from megafab.model.moe.balancing import LossScale
from megafab.model.moe.dispatcher import DISPATCHERS
from megafab.model.moe.experts import ExpertShape, GroupedExperts, SequentialExperts
from megafab.model.moe.router import TopKRouter
from megafab.model.moe.settings import MoESettings
from megafab.model.moe.shared_experts import SharedExpertMLP
from megafab.model.recompute import RecomputeSettings, recompute
from megafab.param_names import MTP_LAYERS, parse_index


class MoELayer(nn.Module):
    def __init__(self, settings: MoESettings, cfg, ctx, prefix: str, *, activation, ep_group=None,
                 etp_group=None, tp_ep_group=None, tp_cp_group=None, tp_dp_cp_group=None,
                 loss_scale: LossScale | None = None, calculate_per_token_loss: bool = False):
        """cfg: the model config (hidden_size, ffn_hidden_size, add_bias_linear, init_method_std,
        num_layers); activation: the experts' MLPActivation (model/activations.py); ctx: the
        LayerContext; prefix: this MLP's global parameter name prefix ("decoder.layers.L.mlp."),
        which keys the initialization. Groups (None: one
        rank; EP 1 needs no process group): ep_group splits the experts, etp_group shards each
        expert, tp_ep_group is their product (dispatcher.py, experts.py); tp_cp_group and
        tp_dp_cp_group are the router's token-count groups (router.py)."""
        super().__init__()
        self.settings = settings
        # --recompute-modules moe (the whole layer) and shared_experts: checkpointed on their input;
        # moe_act: the grouped experts' activation (experts.py)
        recompute_settings = RecomputeSettings.from_model_config(cfg, check=False)
        self.recompute_layer, self.recompute_shared = (recompute_settings.selects(m)
                                                       for m in ("moe", "shared_experts"))
        self.rng_tracker, self.device = ctx.rng_tracker, ctx.device
        self.router = TopKRouter(
            settings, cfg.hidden_size, init_method_std=cfg.init_method_std, seed=ctx.seed,
            prefix=prefix + "router.", params_dtype=ctx.params_dtype, device=ctx.device,
            bias=cfg.add_bias_linear, sequence_parallel=ctx.sequence_parallel, loss_scale=loss_scale,
            calculate_per_token_loss=calculate_per_token_loss, tp_cp_group=tp_cp_group,
            tp_dp_cp_group=tp_dp_cp_group)
        self.router.log_layer = log_layer_index(prefix, cfg.num_layers)
        self.router.random_offset = 100 * group_rank(ep_group) + group_rank(etp_group)
        self.dispatcher = DISPATCHERS[settings.moe_token_dispatcher_type](
            settings.num_experts, ep_group, etp_group, tp_ep_group)
        common = dict(activation=activation, init_method_std=cfg.init_method_std, num_layers=cfg.num_layers)
        shape = ExpertShape(cfg.hidden_size, settings.ffn_hidden_size(cfg.ffn_hidden_size),
                            bias=cfg.add_bias_linear, **common)
        experts = GroupedExperts if settings.moe_grouped_gemm else SequentialExperts
        grouped = {"recompute_activation": recompute_settings.selects("moe_act")} \
            if settings.moe_grouped_gemm else {}
        self.experts = experts(shape, self.dispatcher.num_local_experts, self.dispatcher.first_expert,
                               seed=ctx.seed, prefix=prefix, params_dtype=ctx.params_dtype, device=ctx.device,
                               etp_group=etp_group, **grouped)
        self.shared_experts = None
        if settings.moe_shared_expert_intermediate_size is not None:
            shared = ExpertShape(cfg.hidden_size, settings.moe_shared_expert_intermediate_size, bias=False,
                                 **common)
            self.shared_experts = SharedExpertMLP(shared, gate=settings.moe_shared_expert_gate, seed=ctx.seed,
                                                  prefix=prefix + "shared_experts.", ctx=ctx)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        """hidden [s, b, h] -> ([s, b, h], None): the routed (and shared) experts' output; the
        second value is megatron-core's mlp_bias, always None for MoE. moe_shared_expert_overlap
        computes the same sum (megatron-core adds the shared output inside the dispatcher's
        combine); here the shared experts simply run first, no side stream yet."""
        if self.recompute_layer and self.training:
            return recompute(self._forward, hidden, tracker=self.rng_tracker, device=self.device), None
        return self._forward(hidden), None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = None
        if self.shared_experts is not None and self.recompute_shared and self.training:
            shared = recompute(self.shared_experts, hidden, tracker=self.rng_tracker, device=self.device)
        elif self.shared_experts is not None:
            shared = self.shared_experts(hidden)
        probs, routing_map = self.router(hidden)  # [s*b, E]
        rows, tokens_per_expert, row_probs, state = self.dispatcher.dispatch(
            hidden.reshape(-1, hidden.shape[-1]), probs, routing_map)
        out = self.dispatcher.combine(self.experts(rows, tokens_per_expert, row_probs), state)
        out = out.view(hidden.shape)
        return out if shared is None else out + shared


def log_layer_index(prefix: str, num_layers: int) -> int | None:
    """The index of the layer whose MLP has parameter prefix `prefix` in Megatron's per-layer MoE
    log: decoder layer L -> L, MTP layer i -> num_layers + i (None for any other prefix)."""
    decoder = parse_index(prefix)
    if decoder is not None:
        return decoder[0]
    mtp = parse_index(prefix, MTP_LAYERS)
    return None if mtp is None else num_layers + mtp[0]
