"""One transformer layer (pre-norm attention + MLP), written once for every TP/SP layout.

Shapes: the residual stream is [s, b, h], or [s/tp, b, h] with sequence parallel; inside the TP
regions heads and MLP columns are split, [s, b, heads/tp, d] and [s, b, ffn/tp].
Parameter names follow megatron-core's local spec (input_layernorm, self_attention.linear_qkv,
self_attention.linear_proj, pre_mlp_layernorm, mlp.linear_fc1, mlp.linear_fc2).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megafab.distributed.layers import ColumnParallelLinear, RowParallelLinear
from megafab.distributed.mappings import group_size
from megafab.model.activations import MLPActivation
from megafab.model.core_attention import CoreAttention
from megafab.model.init import normal_init, output_layer_std
from megafab.model.mla import MLASelfAttention
from megafab.model.moe.balancing import LossScale
from megafab.model.moe.layer import MoELayer
from megafab.model.moe.settings import MoESettings
from megafab.model.norms import build_norm
from megafab.model.recompute import DiscardedOutput, RecomputeSettings, recompute
from megafab.model.rotary import apply_rotary
from megafab.param_names import layer_prefix, partition_stride

# SDPA takes grouped keys/values itself from torch 2.5 (enable_gqa); older torch repeats them here.
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class LayerContext:
    """What every layer of a model chunk shares: groups, precision, seed and the RNG tracker."""

    tp_group: object
    sequence_parallel: bool
    params_dtype: torch.dtype
    device: torch.device
    seed: int
    rng_tracker: object = None
    precision: object = None  # PrecisionConfig: the Transformer Engine layers read --fp8-* here
    gradient_accumulation_fusion: bool = True  # weight grads straight into DDP's main_grad buffer
    cp_group: object = None  # context parallel: this rank holds 2 of 2*cp sequence chunks
    cp_comm_type: str = "p2p"
    fp8_group: object = None  # FP8 amax reductions (TP x DP x CP; model/te.py's fp8_amax_group)
    # Mixture of experts (moe/): which layers route (None: a dense model) and the groups they use
    moe: MoESettings | None = None
    ep_group: object = None  # the experts are split over it
    etp_group: object = None  # each expert's weights are split over it (expert tensor parallel)
    tp_ep_group: object = None  # ETP x EP (megatron's expert tensor and model parallel group)
    tp_cp_group: object = None  # the other tokens of the same sequences (aux_loss token counts)
    tp_dp_cp_group: object = None  # every token of this stage's global batch (global_aux_loss, bias)
    moe_loss_scale: LossScale | None = None  # the balancing losses' backward weight, set per step
    calculate_per_token_loss: bool = False  # --calculate-per-token-loss (the balancing losses' scale)

    def tp_region_rng(self):
        """Dropout on tensors that differ across TP ranks draws from the per-rank stream."""
        return self.rng_tracker.fork() if self.rng_tracker is not None else contextlib.nullcontext()

    def residual_rng(self):
        """The residual stream is TP-sharded (so per-rank RNG) only under sequence parallel."""
        return self.tp_region_rng() if self.sequence_parallel else contextlib.nullcontext()


class SelfAttention(nn.Module):
    """Causal self-attention, multi-head or grouped-query, heads split over TP.

    linear_qkv packs each key/value group as [q_1 .. q_{heads/groups}, k, v] (megatron-core's
    layout), so a TP shard holds whole groups. layer_number (0-based, global): whether its
    core_attention is windowed (model/core_attention.py).
    """

    def __init__(self, cfg, ctx: LayerContext, prefix: str, layer_number: int = 0):
        super().__init__()
        tp = group_size(ctx.tp_group)
        self.ctx = ctx
        self.d = cfg.kv_channels
        self.heads_per_group = cfg.num_attention_heads // cfg.num_query_groups
        self.groups_local = cfg.num_query_groups // tp
        self.dropout = cfg.attention_dropout
        self.rotary_interleaved = cfg.rotary_interleaved
        self.recompute_core_attention = RecomputeSettings.from_model_config(cfg).core_attention
        qkv_out = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * self.d
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:
            # Each TP rank normalizes its own heads with the same (replicated) weights, so each
            # rank's gradient is a partial sum: finalize_model_grads sums it over TP.
            self.q_layernorm, self.k_layernorm = build_norm(cfg, ctx, self.d), build_norm(cfg, ctx, self.d)
            for p in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
                p.sequence_parallel, p.grad_sum_over_tp = False, True
        self.linear_qkv = ColumnParallelLinear(
            cfg.hidden_size, qkv_out, tp_group=ctx.tp_group, bias=cfg.add_bias_linear or cfg.add_qkv_bias,
            sequence_parallel=ctx.sequence_parallel, params_dtype=ctx.params_dtype, device=ctx.device,
            gradient_accumulation_fusion=ctx.gradient_accumulation_fusion,
            init_method=normal_init(ctx.seed, prefix + "linear_qkv.weight", cfg.init_method_std))
        self.linear_proj = RowParallelLinear(
            cfg.num_attention_heads * self.d, cfg.hidden_size, tp_group=ctx.tp_group,
            bias=cfg.add_bias_linear, input_is_parallel=True, sequence_parallel=ctx.sequence_parallel,
            params_dtype=ctx.params_dtype, device=ctx.device,
            gradient_accumulation_fusion=ctx.gradient_accumulation_fusion,
            init_method=normal_init(ctx.seed, prefix + "linear_proj.weight",
                                    output_layer_std(cfg.init_method_std, cfg.num_layers)))
        # softmax(q k^T / sqrt(d)) v, windowed and with sinks as configured: [b, heads/tp, s, d]
        self.core_attention = CoreAttention(cfg, ctx, prefix, layer_number)

    def forward(self, x, rotary_angles=None, attention_mask=None, kv_cache=None):
        """kv_cache (generation): holds this layer's keys/values of earlier positions; x then
        carries only the new positions and attention_mask must cover [new, cached + new]."""
        qkv, _ = self.linear_qkv(x)  # [s, b, groups/tp * (hpg + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups_local, self.heads_per_group + 2, self.d)
        q = qkv[:, :, :, : self.heads_per_group].reshape(s, b, -1, self.d)  # [s, b, heads/tp, d]
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # [s, b, groups/tp, d]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary_angles is not None:
            q = apply_rotary(q, rotary_angles, interleaved=self.rotary_interleaved)
            k = apply_rotary(k, rotary_angles, interleaved=self.rotary_interleaved)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # [b, groups/tp, s_cached + s, d]
        if self.heads_per_group > 1 and not SDPA_GQA:
            k = k.repeat_interleave(self.heads_per_group, dim=1)
            v = v.repeat_interleave(self.heads_per_group, dim=1)
        dropout = self.dropout if self.training else 0.0
        if self.recompute_core_attention and self.training:
            ctx = recompute(self.core_attention, q, k, v, attention_mask, dropout,
                            tracker=self.ctx.rng_tracker, device=self.ctx.device)
        else:
            ctx = self.core_attention(q, k, v, attention_mask, dropout)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads/tp * d]
        out, _ = self.linear_proj(ctx)
        return out


class MLP(nn.Module):
    """h -> ffn (GELU, tanh GELU or squared ReLU) -> h, or a gated unit (SwiGLU, gpt-oss's clamped
    quick-GEGLU) with fc1 packed [gate; linear] and split with stride 2 (model/activations.py)."""

    def __init__(self, cfg, ctx: LayerContext, prefix: str):
        super().__init__()
        self.activation = MLPActivation.from_model_config(cfg)
        fc1_out = cfg.ffn_hidden_size * (2 if self.activation.gated else 1)
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size, fc1_out, tp_group=ctx.tp_group, bias=cfg.add_bias_linear,
            sequence_parallel=ctx.sequence_parallel,
            stride=partition_stride(prefix + "linear_fc1.weight", self.activation.gated),
            params_dtype=ctx.params_dtype, device=ctx.device,
            gradient_accumulation_fusion=ctx.gradient_accumulation_fusion,
            init_method=normal_init(ctx.seed, prefix + "linear_fc1.weight", cfg.init_method_std))
        self.linear_fc2 = RowParallelLinear(
            cfg.ffn_hidden_size, cfg.hidden_size, tp_group=ctx.tp_group, bias=cfg.add_bias_linear,
            input_is_parallel=True, sequence_parallel=ctx.sequence_parallel,
            params_dtype=ctx.params_dtype, device=ctx.device,
            gradient_accumulation_fusion=ctx.gradient_accumulation_fusion,
            init_method=normal_init(ctx.seed, prefix + "linear_fc2.weight",
                                    output_layer_std(cfg.init_method_std, cfg.num_layers)))

    def forward(self, x):
        h, _ = self.linear_fc1(x)  # bias added: the activation clamps fc1's whole output
        out, _ = self.linear_fc2(self.activation(h))
        return out


def build_mlp(cfg, ctx: LayerContext, layer_number: int, prefix: str) -> nn.Module:
    """The MLP of global layer `layer_number`: an MoELayer where --moe-layer-freq makes it one
    (its input is the residual stream as it is, [s/tp, b, h] under SP), else the dense MLP."""
    if ctx.moe is None or not ctx.moe.is_moe_layer(layer_number):
        return MLP(cfg, ctx, prefix)
    return MoELayer(ctx.moe, cfg, ctx, prefix, activation=MLPActivation.from_model_config(cfg),
                    ep_group=ctx.ep_group, etp_group=ctx.etp_group, tp_ep_group=ctx.tp_ep_group,
                    tp_cp_group=ctx.tp_cp_group, tp_dp_cp_group=ctx.tp_dp_cp_group,
                    loss_scale=ctx.moe_loss_scale, calculate_per_token_loss=ctx.calculate_per_token_loss)


class TransformerLayer(nn.Module):
    def __init__(self, cfg, ctx: LayerContext, layer_number: int, prefix: str | None = None):
        """prefix: the parameters' name prefix (their init seeds), default `decoder.layers.<N>.`; an
        MTP layer's is `mtp.layers.<i>.transformer_layer.` and its layer_number the kind it copies."""
        super().__init__()
        prefix = prefix or layer_prefix(layer_number)
        self.ctx = ctx
        self.hidden_dropout = cfg.hidden_dropout
        self.residual_post_norm = cfg.apply_residual_connection_post_layernorm
        self.input_layernorm = build_norm(cfg, ctx)
        if cfg.multi_latent_attention:
            self.self_attention = MLASelfAttention(cfg, ctx, prefix + "self_attention.")
        else:
            self.self_attention = SelfAttention(cfg, ctx, prefix + "self_attention.", layer_number)
        self.pre_mlp_layernorm = build_norm(cfg, ctx)
        self.mlp = build_mlp(cfg, ctx, layer_number, prefix + "mlp.")
        self.recompute = RecomputeSettings.from_model_config(cfg)  # the selective modules

    def _dropout(self, x):
        if not self.training or self.hidden_dropout == 0.0:
            return x
        with self.ctx.residual_rng():
            return F.dropout(x, self.hidden_dropout, training=True)

    def forward(self, x, rotary_angles=None, attention_mask=None, kv_cache=None):
        # --recompute-modules layernorm: each norm's output is freed once its consumers saved it and
        # recomputed when the gradient of the consumer's output arrives (model/recompute.py)
        norm = self._norm_region(self.input_layernorm)
        normed = norm(x)
        residual = normed if self.residual_post_norm else x
        attention = self.self_attention(normed, rotary_angles, attention_mask, kv_cache)
        x = residual + self._dropout(attention)
        norm.discard(attention)
        norm = self._norm_region(self.pre_mlp_layernorm)
        normed = norm(x)
        residual = normed if self.residual_post_norm else x
        if self.recompute.selects("mlp") and self.training and isinstance(self.mlp, MLP):
            out = recompute(self.mlp, normed, tracker=self.ctx.rng_tracker, device=self.ctx.device)
        else:
            out = self.mlp(normed)
        if isinstance(out, tuple):  # MoELayer: (output, mlp_bias None) as megatron-core's
            out = out[0]
        x = residual + self._dropout(out)
        norm.discard(out)
        return x

    def _norm_region(self, norm: nn.Module) -> DiscardedOutput:
        return DiscardedOutput(norm, norm, self.recompute.selects("layernorm") and self.training)
