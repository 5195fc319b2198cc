"""megafab's checkpoint keys <-> Megatron-LM torch_dist keys, box by box.

megatron-core's torch_dist (GPTModel.sharded_state_dict) holds the same global tensors as megafab
(layout.py), named and stacked differently (megatron_name): transformer layers stacked on a
leading dim (`decoder.layers.<suffix>` [L, ...], unless saved with non_homogeneous_layers:
stacks_layers), layer norms under Transformer Engine names, routed experts as
`mlp.experts.experts.*`, and SwiGLU's fc1 as one [2f, h] tensor where megafab keeps a [2, f, h]
view (_megatron_boxes). There is no `model.` prefix; optimizer state is
`optimizer.state.<kind>.<key>`, shaped and boxed like the parameter (to_megatron), Adam's step in
common.pt. Multi-latent attention layers keep their norms unfused (MLA_TE_NAMES).

Every translated box is a view of the megafab box's view: translating copies nothing.
"""

from __future__ import annotations

import torch

from megafab.checkpoint.boxes import Box
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import (
    MAIN_PARAM,
    MODEL_PREFIX,
    STEP,
    Shard,
    model_key,
    optim_key,
    split_key,
    strided_dim,
    strided_shape,
)
from megafab.model.activations import gated_linear_unit
from megafab.param_names import (
    LAYERS,
    dist_expert_name,
    local_to_te_name,
    parse_index,
    stacked_name,
    te_to_local_name,
    undist_expert_name,
    unstacked_name,
)

OPTIM_STATE = "optimizer.state."
# megatron-core's distributed optimizer in its bucket-space formats (dp_reshardable, Megatron-LM's
# default, and dp_zero_gather_scatter / fully_sharded_bucket_space): flat per-bucket buffers, e.g.
# optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg
OPTIM_BUCKETS = "optimizer.distributed."
MAIN_PARAM_KINDS = ("fp32_param", "param")  # plain optimizer, distributed optimizer
# Megatron's linear modules carry an `_extra_state` (None for the local spec, FP8 metadata under
# Transformer Engine, whose core attention has one too); megatron-core's torch_dist loader asks for
# each its model has.
ATTENTION_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj")
LINEAR_MODULES = ATTENTION_MODULES + ("mlp.linear_fc1", "mlp.linear_fc2")
EXTRA_STATE_MODULES = LINEAR_MODULES + ("self_attention.core_attention",)
# An MoE layer's: its attention's, its shared experts' (SHARED_EXPERTS + linear_fc*), and one per
# routed expert's linear_fc1 / linear_fc2 (keys.expert_extra_state_key)
SHARED_EXPERT_MODULES = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_MODULES = ("linear_fc1", "linear_fc2")
# Multi-latent attention (megatron-core's MLA layer specs): no linear_qkv to fuse the input norm into,
# so input_layernorm stays unfused in both specs, and the local spec (no keys map) keeps
# pre_mlp_layernorm unfused too: megafab writes the local spec's names. The Transformer Engine spec
# fuses the latent norms into the up projections (and a dense layer's pre-MLP norm into fc1): read.
MLA_TE_NAMES = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.q_layernorm.bias": "self_attention.linear_q_up_proj.layer_norm_bias",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.bias": "self_attention.linear_kv_up_proj.layer_norm_bias",
}
_MLA_LOCAL_NAMES = {te: local for local, te in MLA_TE_NAMES.items()}  # megafab_name's inverse
MLA_KV_MODULES = ("self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj",
                  "self_attention.linear_proj")


def is_mla(model_cfg) -> bool:
    return bool(getattr(model_cfg, "multi_latent_attention", False))


def attention_modules(model_cfg=None) -> tuple[str, ...]:
    """The attention's linear modules (each has an `_extra_state`): linear_qkv and linear_proj, or
    multi-latent attention's projections (linear_q_proj without a query LoRA)."""
    if not is_mla(model_cfg):
        return ATTENTION_MODULES
    q = ("linear_q_proj",) if model_cfg.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
    return tuple("self_attention." + m for m in q) + MLA_KV_MODULES


def _replace_suffix(name: str, table: dict) -> str:
    for old, new in table.items():
        if name.endswith("." + old):
            return name[:-len(old)] + new
    return name


def megatron_name(name: str, mla: bool = False) -> tuple[str, int | None]:
    """(Megatron key, layer number or None) of megafab parameter `name` (stacked layers).

    megafab's `decoder.layers.N.<suffix>` is row N of Megatron's `decoder.layers.<suffix>` [L, ...],
    L = every layer of the model whatever its PP/VPP split. Layer norms carry Transformer Engine
    names whatever the layer spec (the local spec's input_layernorm is
    self_attention.linear_qkv.layer_norm_*: param_names.TE_NAMES), but in a multi-latent attention
    model (mla), whose local spec keeps every norm unfused. Routed experts'
    `mlp.experts.linear_fc1.weight` [E, 2f, h] (global expert axis) is Megatron's
    `mlp.experts.experts.linear_fc1.weight`, [L, E, 2f, h] stacked."""
    return stacked_name(dist_expert_name(name if mla else local_to_te_name(name)))


def megafab_name(key: str, layer: int | None, te_names: bool = False) -> str:
    """Inverse of megatron_name: the local-spec name (a full megafab state dict's), or the
    Transformer Engine one (te_names: a --transformer-impl transformer_engine model's); MLA's
    Transformer Engine latent norms read as the local q_layernorm / kv_layernorm."""
    name = _replace_suffix(undist_expert_name(unstacked_name(key, layer)), _MLA_LOCAL_NAMES)
    return name if te_names else te_to_local_name(name) or name


def stacks_layers(moe) -> bool:
    """Whether megatron-core stacks a model's layers in torch_dist: not when MoE and dense layers
    alternate (--moe-layer-freq other than 1: its non_homogeneous_layers). moe: cfg.moe or None."""
    if moe is None or moe.num_experts is None:
        return True
    return isinstance(moe.moe_layer_freq, int) and moe.moe_layer_freq == 1


def megatron_optim_key(kind: str, key: str) -> str:
    return f"{OPTIM_STATE}{kind}.{key}"


def _split_megatron_key(key: str) -> tuple[str, str | None]:
    """(parameter key, optimizer kind or None)."""
    if key.startswith(OPTIM_STATE):
        kind, _, param = key[len(OPTIM_STATE):].partition(".")
        return param, kind
    return key, None


def parameter_keys(stored_keys) -> set[str]:
    """The parameter keys a checkpoint's tensors are stored under (optimizer kinds stripped)."""
    return {_split_megatron_key(k)[0] for k in stored_keys}


def is_stacked(stored_keys) -> bool:
    """False for a checkpoint saved with non_homogeneous_layers (per-layer keys)."""
    return not any(parse_index(_split_megatron_key(k)[0]) for k in stored_keys)


# ---- Shards: megafab keys -> Megatron keys ----------------------------------------------------------
def _megatron_boxes(box: Box, view, layer: int | None, stacked: bool, strided: tuple[int, int] | None):
    """(Megatron box, view) pieces of one megafab box of a layer (or non-layer) parameter;
    strided: (dim d, rows f) of a [..., 2, f, ...] stored view. SwiGLU's fc1 is Megatron's one
    [2f, h] = [gate; up] tensor, megafab's [2, f, h] view of the same bytes: a megafab box at
    stride s, rows [o, o + n) is Megatron's rows [s f + o, s f + o + n) (routed experts: the same
    on dim 1 of [E, 2, f, h])."""
    pieces = [(box, view)]
    if strided is not None:  # [.., 2, f, ...] -> [.., 2f, ...]: one piece per stride row in the box
        d, rows = strided
        o, n = box.offsets, box.sizes
        pieces = [(Box((*o[:d], s * rows + o[d + 1], *o[d + 2:]), (*n[:d], *n[d + 1:])),
                   view.select(d, s - o[d]))
                  for s in range(o[d], o[d] + n[d])]
    if layer is None or not stacked:
        return pieces
    return [(Box((layer, *b.offsets), (1, *b.sizes)), v.unsqueeze(0)) for b, v in pieces]


def _stored_name(name: str, stored_keys, mla: bool = False) -> tuple[str, int | None]:
    """megatron_name, or, reading a checkpoint whose spec fuses a norm otherwise, the name it has
    there: unfused (Transformer Engine's spec of an MoE layer: `pre_mlp_layernorm.weight`, there
    being no linear_fc1 to fuse it into), fused (an MLA model's dense layer under Transformer
    Engine: `mlp.linear_fc1.layer_norm_weight`), or MLA's latent norms fused (MLA_TE_NAMES)."""
    def stored(key_layer):  # stacked, or per layer (non_homogeneous_layers)
        key, layer = key_layer
        return key in stored_keys or (layer is not None and unstacked_name(key, layer) in stored_keys)

    base = megatron_name(name, mla)
    if stored_keys is not None and not stored(base):
        for other in (megatron_name(name, not mla), megatron_name(_replace_suffix(name, MLA_TE_NAMES), True)):
            if stored(other):
                return other
    return base


def to_megatron(shards: dict[str, Shard], model_cfg, main_kind: str = "fp32_param",
                stacked: bool = True, stored_keys=None) -> dict[str, Shard]:
    """The Shards of megafab keys (model.* / optim.*) as Shards of Megatron keys, the same views.
    `step` entries are left out (Megatron keeps Adam's step in common.pt). stored_keys (reading): the
    checkpoint's parameter keys (optimizer kinds stripped), for the names a spec may keep unfused.
    Optimizer kinds are the torch optimizer's own (exp_avg, exp_avg_sq; momentum_buffer) and the
    fp32 main copy, main_kind: `fp32_param` (plain optimizer) or `param` (fully_reshardable)."""
    num_layers, mla = model_cfg.num_layers, is_mla(model_cfg)
    out: dict[str, Shard] = {}
    for key, shard in shards.items():
        name, kind = split_key(key)
        if kind == STEP:
            continue
        base, layer = _stored_name(name, stored_keys, mla)
        dim = strided_dim(name, gated_linear_unit(model_cfg))
        shape = tuple(shard.global_shape)
        if dim is not None:
            shape = (*shape[:dim], shape[dim] * shape[dim + 1], *shape[dim + 2:])
        if layer is not None and stacked:
            shape = (num_layers, *shape)
        elif layer is not None:
            base = unstacked_name(base, layer)
        if kind is not None:
            base = megatron_optim_key(main_kind if kind == MAIN_PARAM else kind, base)
        target = out.setdefault(base, Shard(shape, write=shard.write))
        assert target.global_shape == shape, (key, target.global_shape, shape)
        strided = None if dim is None else (dim, shard.global_shape[dim + 1])
        for box, view in zip(shard.boxes, shard.views):
            for b, v in _megatron_boxes(box, view, layer, stacked, strided):
                target.add(b, v)
    return out


# ---- what a Megatron checkpoint holds, in megafab keys ----------------------------------------------
def megafab_view(stored: dict, model_cfg, path: str) -> dict:
    """DCP metadata of a Megatron checkpoint (key -> TensorStorageMetadata) as megafab keys ->
    TensorStorageMetadata of the global (stored-view) shape megafab's Shards have, so that the
    shape checks and vocabulary resharding of megafab checkpoints apply unchanged."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stacked = is_stacked(stored)
    te_names = model_cfg.transformer_impl == "transformer_engine"
    out = {}
    for key, md in stored.items():
        if not isinstance(md, TensorStorageMetadata) or key.endswith("_extra_state"):
            continue
        param, kind = _split_megatron_key(key)
        size = tuple(md.size)
        layers = [None]
        param, layer = stacked_name(param)
        if layer is not None:  # non_homogeneous_layers: one key per layer
            layers = [layer]
        elif param.startswith(LAYERS) and stacked:
            if size[0] != model_cfg.num_layers:
                raise CheckpointError(
                    f"{path}: checkpoint tensor {key!r} stacks {size[0]} layers but this model has "
                    f"--num-layers {model_cfg.num_layers}; pass the checkpoint's --num-layers")
            layers, size = range(size[0]), size[1:]
        for layer in layers:
            name = megafab_name(param, layer, te_names)
            dim = strided_dim(name, gated_linear_unit(model_cfg))
            shape = size if dim is None else strided_shape(size, dim, 2)
            fab_key = model_key(name) if kind is None else optim_key(
                name, MAIN_PARAM if kind in MAIN_PARAM_KINDS else kind)
            out[fab_key] = TensorStorageMetadata(md.properties, torch.Size(shape), [])
    return out


def model_names(view: dict) -> list[str]:
    """The megafab parameter names a megafab_view holds weights for."""
    return [k[len(MODEL_PREFIX):] for k in view if k.startswith(MODEL_PREFIX)]
