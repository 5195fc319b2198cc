"""Parameter names: the one place their grammar is written (built, parsed, renumbered) and the one
table of how tensor parallelism splits each parameter (TP_SPLITS, tp_partition). The model builds
its names here, the layers take their partition attributes from here, every checkpoint reader and
writer parses here. Names are megatron-core's (GPTModel.state_dict, local spec):

    embedding.word_embeddings.weight          [V_padded, h]  vocab rows split over TP
    embedding.position_embeddings.weight      learned absolute positions only
    decoder.layers.<N>.<suffix>               layer N: global numbers in state dicts and checkpoints,
                                              from 0 per pipeline stage in Megatron's legacy files
    decoder.final_layernorm.{weight,bias}
    output_layer.weight                       untied output layer (or a tied last stage's copy)

A numbered family is `<root><N>.<rest>` (parse_index): layers, and MoE's experts (is_moe_name). Also here:
torch_dist's stacked layers, TE's fused norms (local_to_te_name), legacy rank files (rank_dir, chunk_key).
"""

from __future__ import annotations

from dataclasses import dataclass

LAYERS = "decoder.layers."
WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
VOCAB_PADDED = (WORD_EMBEDDING, OUTPUT_LAYER)  # dim 0 is the padded vocabulary
EXTRA_STATE = "_extra_state"
ROUTER = "mlp.router."
EXPERT_BIAS = ROUTER + "expert_bias"  # a buffer, the one non-parameter tensor checkpoints keep
SHARED_EXPERTS = "mlp.shared_experts."
EXPERTS = "mlp.experts."  # grouped (and checkpoint) names: mlp.experts.linear_fc1.weight [E, out, in]
LOCAL_EXPERTS = EXPERTS + "local_experts."  # sequential: mlp.experts.local_experts.<i>.linear_fc1.weight
DIST_EXPERTS = EXPERTS + "experts."  # megatron-core's torch_dist key of the grouped tensor


# ---- numbered names -------------------------------------------------------------------------------
def parse_index(name: str, root: str = LAYERS) -> tuple[int, str] | None:
    """(N, rest) of `<root><N>.<rest>`, None for any other name."""
    if not name.startswith(root):
        return None
    number, dot, rest = name[len(root):].partition(".")
    if not (dot and rest and number.isdigit()):
        return None
    return int(number), rest


def layer_prefix(layer: int, root: str = LAYERS) -> str:
    """`decoder.layers.<layer>.` (or another numbered root's, e.g. a HF format's `model.layers.`)."""
    return f"{root}{layer}."


def layer_module(layer: int) -> str:
    """The module path of layer `layer`: `decoder.layers.<layer>` (no trailing dot)."""
    return layer_prefix(layer)[:-1]


def module_layer(path: str) -> int | None:
    """The layer number of a module path `decoder.layers.<N>`, None for any other module."""
    number = path[len(LAYERS):] if path.startswith(LAYERS) else ""
    return int(number) if number.isdigit() else None


def layer_name(layer: int, suffix: str, root: str = LAYERS) -> str:
    return layer_prefix(layer, root) + suffix


def layer_of(name: str) -> int | None:
    parsed = parse_index(name)
    return None if parsed is None else parsed[0]


def renumber(name: str, delta: int) -> str:
    """`name` with its layer number moved by delta (non-layer names unchanged): to_stage / to_global."""
    parsed = parse_index(name)
    return name if parsed is None else layer_name(parsed[0] + delta, parsed[1])


def to_stage(name: str, first_layer: int) -> str:
    """A global name as a pipeline stage (or virtual chunk) starting at first_layer numbers it."""
    return renumber(name, -first_layer)


def to_global(name: str, first_layer: int) -> str:
    """Inverse of to_stage."""
    return renumber(name, first_layer)


def layer_order(name: str) -> tuple[int, str]:
    """Sort key: non-layer names first, then layer by layer."""
    layer = layer_of(name)
    return (-1 if layer is None else layer, name)


# ---- multi-token prediction (megatron-core 0.16.1's MultiTokenPredictionBlock) ----------------------
# mtp.layers.<i>.{enorm,hnorm,final_layernorm}.weight (.bias with LayerNorm), mtp.layers.<i>.eh_proj.weight
# [h, 2h] (column-parallel), mtp.layers.<i>.transformer_layer.<a decoder layer's suffix>; depth i from 0.
MTP_LAYERS = "mtp.layers."
MTP_TRANSFORMER_LAYER = "transformer_layer."


def mtp_layer_module(depth: int) -> str:
    """The module path of MTP depth `depth` (from 0): `mtp.layers.<depth>`."""
    return layer_prefix(depth, MTP_LAYERS)[:-1]


def module_mtp_layer(path: str) -> int | None:
    """The depth of a module path `mtp.layers.<i>`, None for any other module."""
    number = path[len(MTP_LAYERS):] if path.startswith(MTP_LAYERS) else ""
    return int(number) if number.isdigit() else None


def mtp_split_key(name: str) -> str | None:
    """The TP_SPLITS key of an MTP parameter name (its transformer layer's: the layer suffix), None
    for any other name."""
    parsed = parse_index(name, MTP_LAYERS)
    if parsed is None:
        return None
    rest = parsed[1]
    return rest[len(MTP_TRANSFORMER_LAYER):] if rest.startswith(MTP_TRANSFORMER_LAYER) else rest


# ---- mixture of experts -----------------------------------------------------------------------------
def _layer_suffix(name: str) -> tuple[str, str]:
    """(prefix, layer suffix) of a decoder or MTP transformer layer's name, ("", name) otherwise."""
    return _layer_split(name) or ("", name)


def _with_suffix(prefix: str, suffix: str) -> str:
    return prefix + suffix


def is_moe_name(name: str) -> bool:
    """A router, shared-expert or routed-expert tensor (of a layer, or a layer's suffix). Mixture of
    experts' names are megatron-core 0.16.1's MoELayer names:

        mlp.router.weight [E, h] (.bias [E]), mlp.router.expert_bias [E] (an fp32 buffer)
        mlp.shared_experts.linear_fc1.weight / linear_fc2.weight / gate_weight [1, h]  (dense-like, TP)
        mlp.experts.local_experts.<i>.linear_fc{1,2}.weight   SequentialMLP: this EP rank's i-th expert
        mlp.experts.linear_fc{1,2}.weight [E_local, out, in]  grouped GEMM: the local experts stacked
    """
    return _layer_suffix(name)[1].startswith((ROUTER, SHARED_EXPERTS, EXPERTS))


def is_routed_expert(name: str) -> bool:
    """A routed expert's weight or bias, sequential or grouped (not the router, not shared experts)."""
    return _layer_suffix(name)[1].startswith(EXPERTS)


def sequential_expert(name: str) -> tuple[int, str] | None:
    """(local expert i, the grouped name) of `...mlp.experts.local_experts.<i>.<rest>`; None otherwise."""
    layer, suffix = _layer_suffix(name)
    parsed = parse_index(suffix, LOCAL_EXPERTS)
    return None if parsed is None else (parsed[0], _with_suffix(layer, EXPERTS + parsed[1]))


def sequential_expert_name(grouped: str, expert: int) -> str:
    """Inverse of sequential_expert: `mlp.experts.<rest>` -> `mlp.experts.local_experts.<expert>.<rest>`."""
    layer, suffix = _layer_suffix(grouped)
    assert suffix.startswith(EXPERTS), grouped
    return _with_suffix(layer, layer_name(expert, suffix[len(EXPERTS):], LOCAL_EXPERTS))


def experts_name(name: str) -> str:
    """The checkpoint name of a routed-expert parameter (the grouped name; others unchanged).
    Checkpoints and full state dicts hold the routed experts under the grouped names with the
    *global* expert axis, `mlp.experts.linear_fc1.weight` [E, 2f, h]: expert g is row g whatever
    the EP size and the sequential or grouped layout, so any EP/ETP/TP/PP layout reads any other (a
    rank holding experts [first, first + E_local) holds those rows: layout.ExpertPlacement)."""
    sequential = sequential_expert(name)
    return name if sequential is None else sequential[1]


def dist_expert_name(name: str) -> str:
    """The torch_dist key of a checkpoint name: routed experts `mlp.experts.experts.<rest>` (the
    same [E, 2f, h] tensor, which torch_dist stacks over layers to [L, E, 2f, h])."""
    layer, suffix = _layer_suffix(name)
    if suffix.startswith(EXPERTS) and not suffix.startswith(DIST_EXPERTS):
        return _with_suffix(layer, DIST_EXPERTS + suffix[len(EXPERTS):])
    return name


def undist_expert_name(key: str) -> str:
    """Inverse of dist_expert_name."""
    layer, suffix = _layer_suffix(key)
    if suffix.startswith(DIST_EXPERTS):
        return _with_suffix(layer, EXPERTS + suffix[len(DIST_EXPERTS):])
    return key


def expert_extra_state_key(module: str, layer: int, num_layers: int | None, expert: int,
                           num_experts: int) -> str:
    """The byte object megatron-core's torch_dist keeps per (layer, expert) for a routed expert's
    linear module (`linear_fc1`): stacked layers (num_layers given)
    `decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_<L>.<E>_<NL>.<NE>`, per-layer
    keys (num_layers None) `decoder.layers.<L>.mlp.experts.experts.linear_fc1._extra_state/shard_<E>_<NE>`."""
    name = f"{DIST_EXPERTS}{module}.{EXTRA_STATE}"
    if num_layers is None:
        return f"{layer_prefix(layer)}{name}/shard_{expert}_{num_experts}"
    return f"{LAYERS}{name}/shard_{layer}.{expert}_{num_layers}.{num_experts}"


# ---- Megatron's stacked layers (torch_dist) --------------------------------------------------------
def stacked_name(name: str) -> tuple[str, int | None]:
    """(`decoder.layers.<suffix>`, N) of `decoder.layers.N.<suffix>`; (name, None) otherwise."""
    parsed = parse_index(name)
    return (name, None) if parsed is None else (LAYERS + parsed[1], parsed[0])


def unstacked_name(key: str, layer: int | None) -> str:
    """Inverse of stacked_name."""
    return key if layer is None else layer_name(layer, key[len(LAYERS):])


def stacked_extra_state_key(module: str, layer: int, num_layers: int) -> str:
    """The byte object megatron-core's torch_dist keeps per stacked layer for a module's
    `_extra_state`: `decoder.layers.<module>._extra_state/shard_<layer>_<num_layers>`."""
    return f"{LAYERS}{module}.{EXTRA_STATE}/shard_{layer}_{num_layers}"


def mtp_extra_state_key(module: str, depth: int) -> str:
    """An MTP layer's module's (not stacked): `mtp.layers.<depth>.<module>._extra_state/shard_0_1`."""
    return f"{layer_prefix(depth, MTP_LAYERS)}{module}.{EXTRA_STATE}/shard_0_1"


def mtp_expert_extra_state_key(module: str, depth: int, expert: int, num_experts: int) -> str:
    """An MTP MoE layer's routed expert's linear module's (not stacked):
    `mtp.layers.<d>.transformer_layer.mlp.experts.experts.linear_fc1._extra_state/shard_<E>_<NE>`."""
    prefix = layer_prefix(depth, MTP_LAYERS) + MTP_TRANSFORMER_LAYER
    return f"{prefix}{DIST_EXPERTS}{module}.{EXTRA_STATE}/shard_{expert}_{num_experts}"


def layer_extra_state_key(module: str, layer: int) -> str:
    """Per-layer keys (non_homogeneous_layers): `decoder.layers.<layer>.<module>._extra_state/shard_0_1`."""
    return f"{layer_prefix(layer)}{module}.{EXTRA_STATE}/shard_0_1"


# ---- Transformer Engine names ----------------------------------------------------------------------
TE_NAMES = {  # local suffix -> TE suffix inside decoder.layers.N. (the norms TE fuses into the linears)
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
_LOCAL_NAMES = {te: local for local, te in TE_NAMES.items()}


def _layer_split(name: str) -> tuple[str, str] | None:
    """(prefix, layer suffix) of a decoder layer's or an MTP transformer layer's parameter."""
    parsed = parse_index(name)
    if parsed is not None:
        return layer_prefix(parsed[0]), parsed[1]
    parsed = parse_index(name, MTP_LAYERS)
    if parsed is not None and parsed[1].startswith(MTP_TRANSFORMER_LAYER):
        prefix = layer_prefix(parsed[0], MTP_LAYERS) + MTP_TRANSFORMER_LAYER
        return prefix, parsed[1][len(MTP_TRANSFORMER_LAYER):]
    return None


def local_to_te_name(name: str) -> str:
    split = _layer_split(name)
    if split is None or split[1] not in TE_NAMES:
        return name
    return split[0] + TE_NAMES[split[1]]


def te_to_local_name(name: str) -> str | None:
    """The local name of a TE parameter; None for TE-only entries (`_extra_state`)."""
    if name.endswith(EXTRA_STATE):
        return None
    split = _layer_split(name)
    if split is None or split[1] not in _LOCAL_NAMES:
        return name
    return split[0] + _LOCAL_NAMES[split[1]]


# ---- Megatron's legacy per-rank files --------------------------------------------------------------
def rank_dir(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """mp_rank_<TP:02d> (PP 1) or mp_rank_<TP:02d>_<PP:03d>, then _<EP:03d> when expert-parallel
    (Megatron-LM's get_checkpoint_name)."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep == 1 else f"{name}_{ep_rank:03d}"


def rank_dir_ranks(name: str, pp: int, ep: int) -> tuple[int, int, int] | None:
    """(TP, PP, EP rank) of a rank directory of a checkpoint saved at PP `pp`, EP `ep` (with one of
    them > 1, mp_rank_XX_YYY names a PP or an EP rank); None for another name."""
    parsed = parse_rank_dir(name)
    if parsed is None:
        return None
    numbers = [int(p) for p in name.split("_")[2:]]
    if len(numbers) != 1 + (pp > 1) + (ep > 1):
        return None
    return numbers[0], numbers[1] if pp > 1 else 0, numbers[-1] if ep > 1 else 0


def is_first_rank_dir(name: str) -> bool:
    """mp_rank_00, mp_rank_00_000 or mp_rank_00_000_000: the file that holds TP, PP and EP rank 0."""
    return parse_rank_dir(name) is not None and all(int(p) == 0 for p in name.split("_")[2:])


def parse_rank_dir(name: str) -> tuple[int, int, bool] | None:
    """(TP rank, PP rank, has an expert-parallel rank) of a rank directory's name, None otherwise."""
    parts = name.split("_")  # mp, rank, TP[, PP[, EP]]
    if parts[:2] != ["mp", "rank"] or not 3 <= len(parts) <= 5 or not all(p.isdigit() for p in parts[2:]):
        return None
    widths = [2, 3, 3][:len(parts) - 2]
    if [len(p) for p in parts[2:]] != widths:
        return None
    return int(parts[2]), int(parts[3]) if len(parts) > 3 else 0, len(parts) == 5


def chunk_key(chunk: int, vpp: int) -> str:
    """The entry of model chunk `chunk` in a legacy rank file: `model`, or model0, model1, ... (VPP)."""
    return "model" if vpp == 1 else f"model{chunk}"


def chunk_keys(state: dict) -> list[str]:
    """The model chunks' entries of a legacy rank file, in chunk order."""
    if "model" in state:
        return ["model"]
    chunks = [k for k in state if isinstance(k, str) and k.startswith("model") and k[5:].isdigit()]
    return sorted(chunks, key=lambda k: int(k[5:]))


# ---- tensor-parallel partitions --------------------------------------------------------------------
COLUMN_DIM = 0  # column-parallel linears split their outputs: weight rows [out/tp, in], the bias
ROW_DIM = 1  # row-parallel linears split their inputs: weight columns [out, in/tp]; bias replicated
VOCAB_DIM = 0  # vocab-parallel embeddings split the (padded) vocabulary rows [V/tp, h]
SWIGLU_STRIDE = 2  # SwiGLU's fc1 is [gate; up]: each TP rank holds [gate_r; up_r]


@dataclass(frozen=True)
class Split:
    """How TP splits a parameter family: along `dim` (Megatron's partition_dim), in `stride` interleaved
    blocks when strided_by_swiglu and the model is SwiGLU (Megatron's partition_stride)."""

    dim: int
    strided_by_swiglu: bool = False


# Family -> Split: full names, or layer suffixes (after decoder.layers.N.). Everything else is
# TP-replicated (norms, row-parallel biases, position embeddings). linear_qkv is packed per query
# group ([q_1 .. q_{heads/groups}, k, v] per group), so a dim-0 block holds whole groups.
TP_SPLITS = {
    WORD_EMBEDDING: Split(VOCAB_DIM),
    OUTPUT_LAYER: Split(VOCAB_DIM),
    "self_attention.linear_qkv.weight": Split(COLUMN_DIM),
    "self_attention.linear_qkv.bias": Split(COLUMN_DIM),
    "self_attention.linear_proj.weight": Split(ROW_DIM),
    "self_attention.core_attention.softmax_offset": Split(0),  # a learnable attention sink per head
    "mlp.linear_fc1.weight": Split(COLUMN_DIM, strided_by_swiglu=True),
    "mlp.linear_fc1.bias": Split(COLUMN_DIM, strided_by_swiglu=True),
    "mlp.linear_fc2.weight": Split(ROW_DIM),
    # multi-latent attention (model/mla.py, the local spec): every projection column-parallel (the
    # down projections too), linear_proj row-parallel as above; q_layernorm / kv_layernorm replicated
    "self_attention.linear_q_proj.weight": Split(COLUMN_DIM),
    "self_attention.linear_q_down_proj.weight": Split(COLUMN_DIM),
    "self_attention.linear_q_up_proj.weight": Split(COLUMN_DIM),
    "self_attention.linear_kv_down_proj.weight": Split(COLUMN_DIM),
    "self_attention.linear_kv_up_proj.weight": Split(COLUMN_DIM),
    "eh_proj.weight": Split(COLUMN_DIM),  # an MTP layer's projection (mtp_split_key)
    # shared experts: the dense MLP's splits over TP
    SHARED_EXPERTS + "linear_fc1.weight": Split(COLUMN_DIM, strided_by_swiglu=True),
    SHARED_EXPERTS + "linear_fc1.bias": Split(COLUMN_DIM, strided_by_swiglu=True),
    SHARED_EXPERTS + "linear_fc2.weight": Split(ROW_DIM),
    # routed experts (grouped names, [E, out, in]) split over expert-TP (ETP) after the expert dim;
    # a sequential expert's [out, in] one dim lower. The router is replicated.
    EXPERTS + "linear_fc1.weight": Split(1 + COLUMN_DIM, strided_by_swiglu=True),
    EXPERTS + "linear_fc1.bias": Split(1 + COLUMN_DIM, strided_by_swiglu=True),
    EXPERTS + "linear_fc2.weight": Split(1 + ROW_DIM),
}


def tp_partition(name: str, swiglu: bool) -> tuple[int, int] | None:
    """(partition_dim, partition_stride) of a TP-split parameter (local or TE name), None for a
    TP-replicated one."""
    local = te_to_local_name(name) or name
    sequential = sequential_expert(local)
    parsed = parse_index(local if sequential is None else sequential[1])
    split = TP_SPLITS.get(local if parsed is None else parsed[1])
    mtp = mtp_split_key(local if sequential is None else sequential[1])
    if split is None and mtp is not None:
        split = TP_SPLITS.get(mtp)
    if split is None:
        return None
    dim = split.dim - (sequential is not None)  # a sequential expert has no expert dim
    return dim, SWIGLU_STRIDE if split.strided_by_swiglu and swiglu else 1


def partition_stride(name: str, swiglu: bool) -> int:
    split = tp_partition(name, swiglu)
    return 1 if split is None else split[1]
