"""TopKRouter: gate, top-k routing, capacity, balancing losses and expert-bias counting.

Megatron-core 0.16.1's order: input jitter -> gate logits (router dtype) -> random logits in their
place (--moe-router-force-load-balancing) -> z-loss attached to the logits -> top-k routing (or
sinkhorn's, model/moe/sinkhorn.py) -> capacity dropping -> balancing losses attached to the probs
(training only) -> tokens per expert counted for the expert bias.

Under activation recompute the side effects (the losses' log, the expert-bias token counts,
global_aux_loss's running counts) happen in the first forward only; the recompute reuses the
running counts that forward saw (model/recompute.py's recompute_phase).

Groups (None: this rank alone): `tp_cp_group` is the group whose ranks hold the other tokens of
the same sequences (TP under SP, and CP): aux_loss and seq_aux_loss count tokens over it.
`tp_dp_cp_group` holds all tokens of the global batch of this stage: global_aux_loss counts over it.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from megafab.distributed.mappings import group_size
from megafab.model.init import normal_init
from megafab.model.moe import balancing
from megafab.model.moe.routing import (
    aux_loss_scores,
    drop_to_capacity,
    gate_logits,
    random_logits,
    topk_routing,
)
from megafab.model.moe.settings import MoESettings
from megafab.model.moe.sinkhorn import sinkhorn_routing
from megafab.model.recompute import recompute_phase

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}

# Megatron's logging names of the balancing losses
LOGGED_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                 "global_aux_loss": "global_load_balancing_loss"}


class TopKRouter(nn.Module):
    def __init__(self, settings: MoESettings, hidden_size: int, *, init_method_std: float, seed: int,
                 prefix: str, params_dtype: torch.dtype, device=None, bias: bool = False,
                 sequence_parallel: bool = False, loss_scale: balancing.LossScale | None = None,
                 calculate_per_token_loss: bool = False, tp_cp_group=None, tp_dp_cp_group=None):
        super().__init__()
        self.settings = settings
        self.num_experts = settings.num_experts
        self.topk = settings.moe_router_topk
        self.loss_scale = loss_scale or balancing.LossScale()
        self.calculate_per_token_loss = calculate_per_token_loss
        self.tp_cp_group, self.tp_dp_cp_group = tp_cp_group, tp_dp_cp_group
        weight = torch.empty(self.num_experts, hidden_size, dtype=torch.float32)
        normal_init(seed, prefix + "weight", init_method_std)(weight)
        self.weight = nn.Parameter(weight.to(device=device, dtype=params_dtype))
        self.weight.sequence_parallel = sequence_parallel
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_experts, dtype=params_dtype, device=device))
            normal_init(seed, prefix + "bias", init_method_std)(self.bias.data)
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)
        if settings.moe_router_enable_expert_bias:
            # float32 whatever the model's dtype, as megatron-core keeps it
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32,
                                                            device=device))
            self.register_buffer("local_tokens_per_expert", torch.zeros(
                self.num_experts, dtype=torch.float32, device=device), persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        if settings.aux_loss_coeff("global_aux_loss") > 0:
            self.register_buffer("global_tokens_per_expert", torch.zeros(
                self.num_experts, dtype=torch.float32, device=device), persistent=False)
            self.register_buffer("global_steps", torch.zeros((), dtype=torch.float32, device=device),
                                 persistent=False)
        # Megatron's logging name -> loss / coeff summed over the forwards since the log last read
        # it (loss_logging.moe_loss_values)
        self.logged_losses: dict[str, torch.Tensor] = {}
        # this layer's index in the per-layer log (--moe-per-layer-logging; MoELayer sets it) and
        # 100 * EP rank + ETP rank (--moe-router-force-load-balancing's draws differ by it)
        self.log_layer: int | None = None
        self.random_offset = 0
        # global_aux_loss's mean counts seen by checkpointed forwards, for their recomputes
        self._replayed_counts: deque[torch.Tensor] = deque()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:  # model.double()
            self.expert_bias.data = self.expert_bias.data.float()
            self.local_tokens_per_expert.data = self.local_tokens_per_expert.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [s, b, h] -> (probs [s*b, E] in the router dtype, routing_map [s*b, E] bool)."""
        s = self.settings
        if s.moe_input_jitter_eps is not None:
            eps = s.moe_input_jitter_eps
            low, high = (torch.tensor(v, dtype=x.dtype, device=x.device) for v in (1.0 - eps, 1.0 + eps))
            x = x * (low + torch.rand(x.shape, dtype=x.dtype, device=x.device) * (high - low))
        dtype = ROUTER_DTYPES.get(s.moe_router_dtype, x.dtype)
        logits = gate_logits(x, self.weight, self.bias, dtype)  # [s, b, E]
        if s.moe_router_force_load_balancing:  # benchmarks: uniform routing (routing.random_logits)
            logits = random_logits(logits, self.random_offset)
        seq_length, batch = logits.shape[:2]
        logits = logits.view(-1, self.num_experts)
        training = self.training and torch.is_grad_enabled()
        if training and s.moe_z_loss_coeff is not None:
            logits = self._attach_z_loss(logits)
        if s.moe_router_load_balancing_type == "sinkhorn":  # its choice by the module's mode alone
            probs, routing_map = sinkhorn_routing(logits, self.topk, training=self.training)
        else:
            probs, routing_map = topk_routing(
                logits, self.topk, score_function=s.moe_router_score_function,
                pre_softmax=s.moe_router_pre_softmax, num_groups=s.moe_router_num_groups,
                group_topk=s.moe_router_group_topk, scaling_factor=s.moe_router_topk_scaling_factor,
                expert_bias=self.expert_bias)
        if s.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_to_capacity(probs, routing_map, self.topk, s.moe_expert_capacity_factor,
                                                  s.moe_token_drop_policy, s.moe_pad_expert_input_to_capacity)
        if training and any(s.aux_loss_coeff(kind) > 0 for kind in LOGGED_LOSSES):
            probs = self._attach_balancing_losses(probs, logits, seq_length, batch)
        if self.expert_bias is not None and torch.is_grad_enabled() and recompute_phase() != "recompute":
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def _attach_z_loss(self, logits):
        coeff = self.settings.moe_z_loss_coeff / group_size(self.tp_cp_group)
        loss = balancing.z_loss(logits, coeff)
        self._log("z_loss", loss / coeff)
        return balancing.attach_loss(logits, self._per_token(loss, logits.shape[0]), self.loss_scale)

    def _attach_balancing_losses(self, probs, logits, seq_length, batch):
        routing_map, scores = aux_loss_scores(logits, self.topk, self.settings.moe_router_score_function)
        tokens = routing_map.shape[0]
        for kind, name in LOGGED_LOSSES.items():
            coeff = self.settings.aux_loss_coeff(kind)
            if coeff == 0:
                continue
            if kind == "aux_loss":
                group = self.tp_cp_group
                counts = balancing.summed_over(routing_map.sum(dim=0), group)
                loss = balancing.switch_loss(scores, counts, tokens * group_size(group), self.topk,
                                             self.num_experts, coeff)
            elif kind == "seq_aux_loss":
                # each sequence its own batch: experts x batch columns, token counts per sequence
                group = self.tp_cp_group
                per_seq_scores = scores.reshape(seq_length, -1)
                counts = balancing.summed_over(routing_map.reshape(seq_length, -1).sum(dim=0), group)
                loss = balancing.switch_loss(per_seq_scores, counts, seq_length * group_size(group),
                                             self.topk, self.num_experts, coeff) / batch
            else:
                group = self.tp_dp_cp_group
                loss = balancing.switch_loss(scores, self._global_counts(routing_map, group),
                                             tokens * group_size(group), self.topk, self.num_experts, coeff)
            self._log(name, loss / coeff)
            probs = balancing.attach_loss(probs, self._per_token(loss, tokens), self.loss_scale)
        return probs

    def _global_counts(self, routing_map, group):
        """global_aux_loss's tokens per expert: the mean over the step's forwards so far of the
        counts over `group` (this forward's included); a recompute sees its forward's value."""
        phase = recompute_phase()
        if phase == "recompute":
            return self._replayed_counts.popleft()
        self.global_tokens_per_expert += balancing.summed_over(routing_map.sum(dim=0), group)
        self.global_steps += 1
        counts = self.global_tokens_per_expert / self.global_steps
        if phase == "forward":
            self._replayed_counts.append(counts)
        return counts

    def _per_token(self, loss, tokens):
        """With --calculate-per-token-loss Megatron divides every gradient by the step's token count
        in finalize; the attached loss is scaled up by this rank's tokens to cancel that."""
        return loss * tokens if self.calculate_per_token_loss else loss

    def _log(self, name, value):
        if recompute_phase() != "recompute":
            self.logged_losses[name] = value.detach() + self.logged_losses.get(name, 0)

    def reset_step_state(self) -> None:
        """What Megatron clears after each step's backward (finalize_model_grads'
        reset_model_temporary_tensors): global_aux_loss's token counts."""
        if self.settings.aux_loss_coeff("global_aux_loss") > 0:
            self.global_tokens_per_expert.zero_()
            self.global_steps.zero_()
        self._replayed_counts.clear()


def routers_of(modules) -> list[TopKRouter]:
    """Every TopKRouter in `modules` (model chunks, possibly wrapped), in model order."""
    return [m for module in modules for m in module.modules() if isinstance(m, TopKRouter)]
