"""megafab's own layer around Transformer Engine's linears and attention (--transformer-impl
transformer_engine with MoE, MLA, --qk-layernorm, MTP or selective recompute).

UNVERIFIED on a GPU here (TE is not installable without CUDA): written from TE's documented
constructors; tests/model/test_te_wrap.py runs it through a plain-torch stand-in for TE, and
benchmarks/gpu_device_check.sh runs it on a GPU. The local layer is built, then each of its
projections becomes the TE module megatron-core's TE spec puts there, holding the same weights:
the input norm fused into linear_qkv, the pre-MLP norm into a dense linear_fc1, MLA's latent norms
into linear_q_up_proj / linear_kv_up_proj (TELayerNormColumnParallelLinear), MLA's down projections
duplicated TE Linears, an MoE layer's separate pre_mlp_layernorm and its shared experts' TE
linears, core attention TE's DotProductAttention. Routed experts stay megafab's grouped experts.
"""

from __future__ import annotations

import torch
from torch import nn

from megafab.distributed.mappings import group_size
from megafab.model.fp8_params import initialize_weight
from megafab.model.init import normal_init
from megafab.model.recompute import DiscardedOutput, RecomputeSettings
from megafab.model.te import TETransformerLayer, _layer_fp8_context, _te_context_parallel
from megafab.model.transformer import TransformerLayer
from megafab.param_names import layer_prefix

PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                    "grad_sum_over_tp", "is_expert")
_ADAPTED: dict = {}  # TE class (or ("attention", class)) -> its adapted subclass


def needs_wrapped_layer(cfg) -> bool:
    """What TETransformerLayer (the dense TE layer) does not build: MLA, MoE, qk norms, MTP's
    prefixed layers, selective recompute, sliding windows and attention sinks go through megafab's
    layer around TE modules."""
    return bool(cfg.multi_latent_attention or cfg.qk_layernorm or local_core_attention(cfg)
                or RecomputeSettings.from_model_config(cfg, check=False).granularity == "selective")


def local_core_attention(cfg) -> bool:
    """A sliding window or attention sinks: the wrapped layer keeps megafab's core attention (the
    same softmax_offset name as megatron-core's TE spec) instead of TE's DotProductAttention."""
    return cfg.window_size is not None or cfg.softmax_type != "vanilla"


def transformer_layer_class(cfg, moe: bool = False):
    """The layer class of --transformer-impl (moe: the model has MoE layers)."""
    if cfg.transformer_impl != "transformer_engine":
        return TransformerLayer
    return TEWrappedTransformerLayer if moe or needs_wrapped_layer(cfg) else TETransformerLayer


def _adapted(te_class: type) -> type:
    """TE's module class returning megafab's (output, bias) pair (bias None: TE adds it)."""
    if te_class not in _ADAPTED:
        _ADAPTED[te_class] = type(te_class.__name__, (te_class,),
                                  {"forward": lambda self, x: (te_class.forward(self, x), None)})
    return _ADAPTED[te_class]


def _copy_param(dst: torch.Tensor, src: torch.Tensor) -> None:
    initialize_weight(dst, src)
    for attr in PARAM_ATTRIBUTES:
        if hasattr(src, attr):
            setattr(dst, attr, getattr(src, attr))


class _Builder:
    """Makes TE modules with one layer's groups, precision and RNG tracker."""

    def __init__(self, cfg, ctx, prefix):
        import transformer_engine.pytorch as te  # deferred: GPU-only optional package

        self.te, self.cfg, self.ctx, self.prefix = te, cfg, ctx, prefix
        self.tp = group_size(ctx.tp_group)
        self.tracker = (lambda: ctx.rng_tracker) if ctx.rng_tracker else None

    def common(self, mode):
        """TE's constructor arguments; mode None: megatron-core's "duplicated" TELinear (whole weight,
        no communication)."""
        split = mode is not None
        return dict(parallel_mode=mode, tp_group=self.ctx.tp_group if split else None,
                    tp_size=self.tp if split else 1, sequence_parallel=split and self.ctx.sequence_parallel,
                    params_dtype=self.ctx.params_dtype, device=self.ctx.device,
                    get_rng_state_tracker=self.tracker)

    def linear(self, local, mode, norm=None, full_name=None):
        """The TE module for `local` (a column/row-parallel linear), its weight copied (or, for a
        duplicated one, the whole seeded tensor `full_name`), `norm`'s parameters fused in."""
        n_in, n_out = local.input_size, local.output_size
        bias = getattr(local, "bias", None) is not None
        if norm is None:
            module = _adapted(self.te.Linear)(n_in, n_out, bias=bias, **self.common(mode))
        else:
            module = _adapted(self.te.LayerNormLinear)(
                n_in, n_out, bias=bias, eps=self.cfg.norm_epsilon, normalization=self.cfg.normalization,
                zero_centered_gamma=self.cfg.apply_layernorm_1p, **self.common(mode))
            _copy_param(module.layer_norm_weight, norm.weight)
            if getattr(norm, "bias", None) is not None:
                _copy_param(module.layer_norm_bias, norm.bias)
            for p in (module.layer_norm_weight, getattr(module, "layer_norm_bias", None)):
                if p is not None:
                    p.sequence_parallel = self.ctx.sequence_parallel
        if full_name is None:
            _copy_param(module.weight, local.weight)
        else:
            full = torch.empty(n_out, n_in, dtype=torch.float64)
            normal_init(self.ctx.seed, self.prefix + full_name, self.cfg.init_method_std)(full)
            initialize_weight(module.weight, full)
            module.weight.sequence_parallel = self.ctx.sequence_parallel  # partial grads under SP
        if bias:
            _copy_param(module.bias, local.bias)
        return module

    def attention(self, heads, kv_channels, groups, scale):
        """TE's DotProductAttention taking megafab's core_attention(q, k, v, mask, dropout) call:
        q [b, heads, s, dk], k [b, groups, s, dk], v [b, groups, s, dv] -> [b, heads, s, dv]."""
        te_class = self.te.DotProductAttention

        def forward(module, q, k, v, attention_mask=None, dropout=None):
            b, h, s = q.shape[:3]
            q, k, v = (t.permute(2, 0, 1, 3).contiguous() for t in (q, k, v))  # sbhd
            if attention_mask is None:
                out = te_class.forward(module, q, k, v)
            else:
                out = te_class.forward(module, q, k, v, attention_mask=attention_mask,
                                       attn_mask_type="arbitrary")
            return out.view(s, b, h, -1).permute(1, 2, 0, 3)

        key = ("attention", te_class)
        if key not in _ADAPTED:  # one adapted class, not one built (and dropped) per layer
            _ADAPTED[key] = type(te_class.__name__, (te_class,), {"forward": forward})
        cls = _ADAPTED[key]
        return cls(heads, kv_channels, num_gqa_groups=groups, attention_dropout=self.cfg.attention_dropout,
                   attn_mask_type="causal", qkv_format="sbhd", softmax_scale=scale, tp_size=self.tp,
                   tp_group=self.ctx.tp_group, sequence_parallel=self.ctx.sequence_parallel,
                   get_rng_state_tracker=self.tracker, **_te_context_parallel(self.ctx))


def wrap_attention(b: _Builder, layer, cfg) -> None:
    attn = layer.self_attention
    if hasattr(attn, "linear_qkv"):  # standard attention: the input norm fused into linear_qkv
        attn.linear_qkv = b.linear(attn.linear_qkv, "column", norm=layer.input_layernorm)
        layer.input_layernorm = nn.Identity()
        if not local_core_attention(cfg):
            attn.core_attention = b.attention(cfg.num_attention_heads, cfg.kv_channels,
                                              cfg.num_query_groups, cfg.kv_channels ** -0.5)
    else:  # MLA: a separate input norm (TENorm), latent norms fused into the up projections
        names = "self_attention."
        if attn.q_lora_rank is None:
            attn.linear_q_proj = b.linear(attn.linear_q_proj, "column")
        else:
            attn.linear_q_down_proj = b.linear(attn.linear_q_down_proj, None,
                                               full_name=names + "linear_q_down_proj.weight")
            attn.linear_q_up_proj = b.linear(attn.linear_q_up_proj, "column", norm=attn.q_layernorm)
            attn.q_layernorm = None
        attn.linear_kv_down_proj = b.linear(attn.linear_kv_down_proj, None,
                                            full_name=names + "linear_kv_down_proj.weight")
        attn.linear_kv_up_proj = b.linear(attn.linear_kv_up_proj, "column", norm=attn.kv_layernorm)
        attn.kv_layernorm = None
        heads = cfg.num_attention_heads
        attn.core_attention = b.attention(heads, (attn.qk + attn.pe, attn.v), heads, attn.scale)
    attn.linear_proj = b.linear(attn.linear_proj, "row")


def wrap_mlp(b: _Builder, layer) -> None:
    mlp = layer.mlp
    if hasattr(mlp, "experts"):  # MoE: pre_mlp_layernorm stays a norm (TENorm); shared experts in TE
        mlp.dispatcher.permute_fusion = layer.ctx.moe.moe_permute_fusion  # TE's fused permutation
        shared = mlp.shared_experts
        if shared is not None:
            shared.linear_fc1 = b.linear(shared.linear_fc1, "column")
            shared.linear_fc2 = b.linear(shared.linear_fc2, "row")
        return
    mlp.linear_fc1 = b.linear(mlp.linear_fc1, "column", norm=layer.pre_mlp_layernorm)
    layer.pre_mlp_layernorm = nn.Identity()
    mlp.linear_fc2 = b.linear(mlp.linear_fc2, "row")


class TEWrappedTransformerLayer(TransformerLayer):
    """TransformerLayer whose projections and core attention are Transformer Engine's modules, with
    megatron-core's TE-spec names (see the module docstring); same weights as the local layer."""

    def __init__(self, cfg, ctx, layer_number: int, prefix: str | None = None):
        super().__init__(cfg, ctx, layer_number, prefix)
        builder = _Builder(cfg, ctx, prefix or layer_prefix(layer_number))
        wrap_attention(builder, self, cfg)
        wrap_mlp(builder, self)

    def forward(self, x, rotary_angles=None, attention_mask=None, kv_cache=None):
        with _layer_fp8_context(self.ctx):
            return super().forward(x, rotary_angles, attention_mask, kv_cache)

    def _norm_region(self, norm: nn.Module) -> DiscardedOutput:
        if isinstance(norm, nn.Identity):  # fused into the next TE linear: nothing to discard
            return DiscardedOutput(norm, norm, False)
        return super()._norm_region(norm)
