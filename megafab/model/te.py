"""Transformer Engine backend (--transformer-impl transformer_engine) and FP8 (--fp8-*).

UNVERIFIED: transformer_engine was not installable where this was written, so TETransformerLayer
has never run; it follows TE's documented API (LayerNormLinear / Linear / DotProductAttention,
fp8_autocast, transformer_engine.common.recipe). Tested on CPU: the checks that refuse TE/FP8
where TE or a capable GPU is missing (transformer_engine_problems, te_layer_problems) and the
parameter-name mapping; tests/model/test_te.py holds the TE-vs-local parity test that runs where
TE is installed. MLA, MoE, qk norms, MTP and selective recompute: model/te_wrap.py.

Layout is megatron-core's TE spec: the input norm fused into linear_qkv and the pre-MLP norm into
linear_fc1, so TE names differ from the local ones only there (param_names.TE_NAMES). FP8: one
fp8_autocast per model chunk's layers, amax reduced over TP x DP x CP (fp8_chunk_context).
Peers of the local layers: CP attention is TE's own over the CP group (_te_context_parallel), FSDP2
shards TE's parameters in the same units (distributed/fsdp.py), and inside an FP8 region every
recompute runs through TE's checkpoint (te_checkpoint, te_region_contexts).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from megafab.distributed.layers import partition_of
from megafab.distributed.mappings import group_rank, group_size
from megafab.errors import MegafabError
from megafab.model.activations import MLPActivation
from megafab.model.attention_backend import set_te_attention_switches
from megafab.model.fp8_params import initialize_weight
from megafab.model.init import normal_init, output_layer_std
from megafab.model.recompute import checkpoint_through
from megafab.model.transformer import apply_rotary
from megafab.param_names import (
    layer_prefix,
    local_to_te_name,
    te_to_local_name,
    tp_partition,
)

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have FP8 tensor cores



TE_CP_COMM_TYPES = {"p2p": "p2p", "allgather": "all_gather", "a2a": "a2a"}  # megafab's -> TE's names


class _Fp8Region(threading.local):
    """How many model chunks' fp8_autocast regions (and TE checkpoint recomputes) this thread is
    inside."""

    depth = 0
    te_recompute = 0


_FP8_REGION = _Fp8Region()


class TransformerEngineError(MegafabError):
    """TE or FP8 was asked for where it cannot run."""


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def to_te_state_dict(state: dict) -> dict:
    return {local_to_te_name(k): v for k, v in state.items()}


def to_local_state_dict(state: dict) -> dict:
    return {te_to_local_name(k): v for k, v in state.items() if te_to_local_name(k) is not None}


def check_transformer_engine(model_cfg, precision_cfg, device) -> None:
    """Refuse TE/FP8 before any process group starts when this machine cannot run them."""
    problems = transformer_engine_problems(model_cfg, precision_cfg, device)
    if problems:
        raise TransformerEngineError("; ".join(problems))


def transformer_engine_problems(model_cfg, precision_cfg, device) -> list[str]:
    """Why this machine cannot run TE/FP8 on `device` (empty when it can, or they are off); what TE's
    layer does not implement is te_layer_problems, a config rule."""
    device = torch.device(device)
    wants_te = model_cfg.transformer_impl == "transformer_engine"
    fp8 = precision_cfg.fp8_format is not None
    problems = []
    if wants_te or fp8:
        what = "--fp8-format" if fp8 else "--transformer-impl transformer_engine"
        if not te_available():  # one message: TE is a CUDA build, its absence says it all on CPU
            where = "" if device.type == "cuda" else f" (a CUDA build; this run is on {device})"
            problems.append(f"{what} needs transformer_engine{where}, which is not installed here; install "
                            f"it on a GPU machine (pip install transformer_engine[pytorch]) or use "
                            f"--transformer-impl local (the default) without --fp8-format")
        elif device.type != "cuda":
            problems.append(f"{what} needs a CUDA GPU but this run is on {device}; use "
                            f"--transformer-impl local (the default) without --fp8-format on CPU")
    if getattr(precision_cfg, "fp8_param_gather", False) and (not te_available() or device.type != "cuda"):
        problems.append(f"--fp8-param-gather needs Transformer Engine on an FP8 GPU (and --fp8-format); this "
                        f"run is on {device}{'' if te_available() else ' without transformer_engine'}: drop "
                        f"--fp8-param-gather here")
    if fp8 and device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            problems.append(f"--fp8-format needs a GPU of compute capability >= 8.9 (Ada/Hopper); this "
                            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}; "
                            f"train in --bf16 without --fp8-format")
    return problems


def te_layer_problems(model_cfg) -> list[str]:
    """What TE's layer does not implement among these model settings (pure; the config check)."""
    if model_cfg.transformer_impl != "transformer_engine":
        return []
    problems = []
    if model_cfg.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm implemented for --transformer-impl local "
                        "only (Transformer Engine's linear_qkv fuses the input norm, so its output is not "
                        "there to add)")
    return problems


def fp8_recipe(precision_cfg):
    """TE's recipe object for --fp8-recipe / --fp8-format / --fp8-margin / --fp8-amax-*."""
    from transformer_engine.common import recipe

    fmt = recipe.Format.E4M3 if precision_cfg.fp8_format == "e4m3" else recipe.Format.HYBRID
    kind = precision_cfg.fp8_recipe
    if kind == "delayed":
        return recipe.DelayedScaling(margin=precision_cfg.fp8_margin, fp8_format=fmt,
                                     amax_history_len=precision_cfg.fp8_amax_history_len,
                                     amax_compute_algo=precision_cfg.fp8_amax_compute_algo)
    makers = {"tensorwise": "Float8CurrentScaling", "mxfp8": "MXFP8BlockScaling",
              "blockwise": "Float8BlockScaling"}
    if kind not in makers or not hasattr(recipe, makers[kind]):
        raise TransformerEngineError(f"--fp8-recipe {kind!r} is not offered by this transformer_engine; "
                                     f"use --fp8-recipe delayed")
    return getattr(recipe, makers[kind])(fp8_format=fmt)


def fp8_enabled(precision_cfg) -> bool:
    return precision_cfg is not None and precision_cfg.fp8_format is not None


def fp8_context(precision_cfg, amax_group=None):
    """TE's fp8_autocast with amax reductions over `amax_group`, or a no-op without --fp8-format."""
    if not fp8_enabled(precision_cfg):
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te

    return te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe(precision_cfg), fp8_group=amax_group)


def fp8_amax_group(topo):
    """Megatron's FP8 amax reduction group: every rank of this rank's TP x DP x CP slice."""
    return topo.group("tp", "dp", "cp")


@contextlib.contextmanager
def fp8_chunk_context(ctx):
    """One fp8_autocast around a model chunk's layers (LayerContext: precision, fp8_group), as
    megatron-core's TransformerBlock: entered once per chunk forward by GPTModel, its amax
    reductions over fp8_amax_group (Megatron's get_amax_reduction_group(with_context_parallel=
    True)). Recomputes started inside run through TE's checkpoint (fp8_recompute_context), so a
    layer re-run in backward keeps its forward's FP8 state; a TE layer run outside any region (an
    MTP depth's) enters its own (_layer_fp8_context)."""
    if not fp8_enabled(ctx.precision):
        yield
        return
    with _fp8_region(ctx):
        _FP8_REGION.depth += 1
        try:
            yield
        finally:
            _FP8_REGION.depth -= 1


def _layer_fp8_context(ctx):
    """A layer's own fp8_autocast, only where no chunk's region is open and TE's checkpoint is not
    recomputing it (its modules keep the forward's FP8 state then)."""
    if _FP8_REGION.depth or _FP8_REGION.te_recompute or not fp8_enabled(ctx.precision):
        return contextlib.nullcontext()
    return _fp8_region(ctx)


@contextlib.contextmanager
def _fp8_region(ctx):
    """fp8_autocast with the amax group, and every recompute inside it through TE's checkpoint."""
    with fp8_context(ctx.precision, ctx.fp8_group), fp8_recompute_context(ctx):
        yield


def fp8_recompute_context(ctx):
    """Under FP8: every recompute started inside runs through TE's checkpoint (te_checkpoint) and
    DiscardedOutput in TE's recompute phases (te_region_contexts); without FP8 a no-op. For a
    recompute started outside an FP8 region (an MTP depth's, as megatron-core's MTP layer)."""
    if not fp8_enabled(ctx.precision):
        return contextlib.nullcontext()
    through = functools.partial(te_checkpoint, tracker=ctx.rng_tracker, tp_group=ctx.tp_group)
    return checkpoint_through(through, functools.partial(te_region_contexts, ctx.precision))


@contextlib.contextmanager
def _te_recompute(inner):
    _FP8_REGION.te_recompute += 1
    try:
        with inner:
            yield
    finally:
        _FP8_REGION.te_recompute -= 1


def te_checkpoint(fn, *args, contexts, tracker=None, tp_group=None):
    """Transformer Engine's checkpoint (te.checkpoint; megatron-core's te_checkpoint), what every
    recompute inside a chunk's FP8 region runs through (recompute.checkpoint_through): TE's
    modules copy their FP8 scaling state in the forward and reuse it in the recompute, which runs in
    backward outside any fp8_autocast (torch's checkpoint would recompute them without FP8).
    Non-reentrant as megafab's own; TE restores the CPU/CUDA generators and the tracker's streams,
    megafab's `contexts` (its recompute phase and RNG snapshot) run as TE's context_fn; saved
    inputs are not split over TP (--distribute-saved-activations is refused)."""
    import transformer_engine.pytorch as te

    def both():
        forward, recompute = contexts()
        return forward, _te_recompute(recompute)

    def run(*inputs):  # a plain function: TE sets attributes on what it checkpoints (not on a method)
        return fn(*inputs)
    return te.checkpoint(run, *args, distribute_saved_activations=False,
                         get_rng_state_tracker=(lambda: tracker) if tracker is not None else None,
                         tp_group=tp_group, use_reentrant=False, context_fn=both)


def te_region_contexts(precision_cfg):
    """DiscardedOutput's (forward, recompute) contexts under FP8, megatron-core's
    CheckpointWithoutOutput(fp8): TE's activation-recompute phases, and the recompute (in backward)
    in an fp8_autocast with the forward's recipe."""
    from transformer_engine.pytorch.distributed import activation_recompute_forward

    @contextlib.contextmanager
    def recompute():
        with fp8_context(precision_cfg), _te_recompute(contextlib.nullcontext()), \
                activation_recompute_forward(activation_recompute=True, recompute_phase=True):
            yield
    return activation_recompute_forward(activation_recompute=True, recompute_phase=False), recompute()


def _te_context_parallel(ctx) -> dict:
    """TE DotProductAttention's CP arguments (megatron-core's TEDotProductAttention)."""
    if ctx.cp_group is None:
        return {}
    import torch.distributed as dist

    return {"cp_group": ctx.cp_group, "cp_global_ranks": dist.get_process_group_ranks(ctx.cp_group),
            "cp_stream": torch.cuda.Stream() if torch.cuda.is_available() else None,
            "cp_comm_type": TE_CP_COMM_TYPES[ctx.cp_comm_type]}


def _init_shard(param, seed, name, std, partition_dim, stride, tp_group):
    """Fill a TE weight with this rank's shard of the name-keyed full tensor (as local layers do); an
    FP8 weight (--fp8-param-gather) quantizes it on copy_, from the model dtype (TE's cast kernels
    take no float64)."""
    shape = list(param.shape)
    shape[partition_dim] *= group_size(tp_group)
    full = torch.empty(shape, dtype=torch.float64)
    normal_init(seed, name, std)(full)
    shard = partition_of(full, partition_dim, group_rank(tp_group), group_size(tp_group), stride)
    initialize_weight(param, shard)


class TETransformerLayer(nn.Module):
    """One pre-norm layer from TE modules with megatron-core's TE names:

        local (decoder.layers.N.)     transformer_engine (decoder.layers.N.)
        input_layernorm.weight        self_attention.linear_qkv.layer_norm_weight
        input_layernorm.bias          self_attention.linear_qkv.layer_norm_bias
        pre_mlp_layernorm.weight      mlp.linear_fc1.layer_norm_weight
        pre_mlp_layernorm.bias        mlp.linear_fc1.layer_norm_bias

    TE modules also carry `_extra_state` (FP8 scaling metadata); converting to local names drops it.

    Expects the same inputs as TransformerLayer: x [s(/tp), b, h], RoPE angles, Megatron's mask.
    It shares the local layer's settings: weights are the same name-keyed shards of the same
    seeded full tensors (_init_shard), attention is causal with scale 1/sqrt(kv_channels), GQA
    over the same query groups, attention dropout from the same RNG tracker, and context
    parallelism over the same CP group and comm type (TE's own CP attention).
    """

    def __init__(self, cfg, ctx, layer_number: int):
        super().__init__()
        import transformer_engine.pytorch as te

        prefix = layer_prefix(layer_number)
        tp = group_size(ctx.tp_group)
        self.ctx = ctx
        self.hidden_dropout = cfg.hidden_dropout
        self.rotary_interleaved = cfg.rotary_interleaved
        self.d = cfg.kv_channels
        self.heads_per_group = cfg.num_attention_heads // cfg.num_query_groups
        self.groups_local = cfg.num_query_groups // tp
        common = dict(tp_group=ctx.tp_group, tp_size=tp, sequence_parallel=ctx.sequence_parallel,
                      params_dtype=ctx.params_dtype, device=ctx.device,
                      get_rng_state_tracker=(lambda: ctx.rng_tracker) if ctx.rng_tracker else None)
        norm = dict(eps=cfg.norm_epsilon, normalization=cfg.normalization,
                    zero_centered_gamma=cfg.apply_layernorm_1p)
        set_te_attention_switches(cfg.attention_backend, cfg.apply_query_key_layer_scaling)
        self.activation = MLPActivation.from_model_config(cfg)
        qkv_out = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * self.d
        ffn_out = cfg.ffn_hidden_size * (2 if self.activation.gated else 1)
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = te.LayerNormLinear(
            cfg.hidden_size, qkv_out, bias=cfg.add_bias_linear or cfg.add_qkv_bias, parallel_mode="column",
            **norm, **common)
        self.self_attention.core_attention = te.DotProductAttention(
            cfg.num_attention_heads, self.d, num_gqa_groups=cfg.num_query_groups,
            attention_dropout=cfg.attention_dropout, attn_mask_type="causal", qkv_format="sbhd",
            softmax_scale=1.0 / math.sqrt(self.d), tp_size=tp, tp_group=ctx.tp_group,
            sequence_parallel=ctx.sequence_parallel, get_rng_state_tracker=common["get_rng_state_tracker"],
            layer_number=layer_number + 1, **_te_context_parallel(ctx))  # TE counts layers from 1
        self.self_attention.linear_proj = te.Linear(
            cfg.num_attention_heads * self.d, cfg.hidden_size, bias=cfg.add_bias_linear,
            parallel_mode="row", **common)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = te.LayerNormLinear(cfg.hidden_size, ffn_out, bias=cfg.add_bias_linear,
                                                 parallel_mode="column", **norm, **common)
        self.mlp.linear_fc2 = te.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.add_bias_linear,
                                        parallel_mode="row", **common)
        std, out_std = cfg.init_method_std, output_layer_std(cfg.init_method_std, cfg.num_layers)
        for module, name, init_std in (
                (self.self_attention.linear_qkv, "self_attention.linear_qkv.weight", std),
                (self.self_attention.linear_proj, "self_attention.linear_proj.weight", out_std),
                (self.mlp.linear_fc1, "mlp.linear_fc1.weight", std),
                (self.mlp.linear_fc2, "mlp.linear_fc2.weight", out_std)):
            dim, stride = tp_partition(prefix + name, self.activation.gated)
            _init_shard(module.weight, ctx.seed, prefix + name, init_std, dim, stride, ctx.tp_group)
            module.weight.partition_stride = stride
            if getattr(module, "bias", None) is not None and module.bias.numel():
                with torch.no_grad():
                    module.bias.zero_()

    def _dropout(self, x):
        if not self.training or self.hidden_dropout == 0.0:
            return x
        with self.ctx.residual_rng():
            return F.dropout(x, self.hidden_dropout, training=True)

    def _attention(self, x, rotary_angles, attention_mask):
        qkv = self.self_attention.linear_qkv(x)  # [s, b, groups/tp * (hpg + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups_local, self.heads_per_group + 2, self.d)
        q = qkv[:, :, :, : self.heads_per_group].reshape(s, b, -1, self.d)  # [s, b, heads/tp, d]
        k, v = qkv[:, :, :, -2].contiguous(), qkv[:, :, :, -1].contiguous()  # [s, b, groups/tp, d]
        if rotary_angles is not None:
            q = apply_rotary(q, rotary_angles, interleaved=self.rotary_interleaved)
            k = apply_rotary(k, rotary_angles, interleaved=self.rotary_interleaved)
        if attention_mask is None:
            ctx = self.self_attention.core_attention(q, k, v)  # [s, b, heads/tp * d]
        else:
            ctx = self.self_attention.core_attention(q, k, v, attention_mask=attention_mask,
                                                     attn_mask_type="arbitrary")
        return self.self_attention.linear_proj(ctx)

    def forward(self, x, rotary_angles=None, attention_mask=None, kv_cache=None):
        if kv_cache is not None:
            raise NotImplementedError("generation with a KV cache uses --transformer-impl local")
        with _layer_fp8_context(self.ctx):
            x = x + self._dropout(self._attention(x, rotary_angles, attention_mask))
            h = self.mlp.linear_fc1(x)
            return x + self._dropout(self.mlp.linear_fc2(self.activation(h)))
