"""Where every tensor of a megafab checkpoint lives: one rule for training, conversion and generation.

Keys are the same in every TP/PP/VPP/DP layout and for both optimizers, so any layout loads any
other: `model.<name>` and `optim.<name>.<kind>` (optim_key), <name> megatron-core's global
parameter name. Every tensor is stored under its global (TP=1) shape; strided parameters are
stored with their blocks on a leading axis (strided_shape), routed experts with the global expert
axis first (ExpertPlacement), and the tied output layer not at all (stored_name). Dim 0 of the
word embedding and of an untied output layer is the padded vocabulary (megafab.checkpoint.vocab).
On disk the keys are Megatron's (megatron_keys.py).

A rank's part of a parameter is its ParamLayout (stored name, global shape, its TP block); any flat
range of the block is a Shard, a few rectangular boxes of the global tensor (boxes.py). A rank
writes the Shards of what it owns, reads those it will own, and never holds more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megafab.checkpoint.boxes import Box, flat_range_boxes
from megafab.model.activations import gated_linear_unit
from megafab.param_names import (
    OUTPUT_LAYER,
    WORD_EMBEDDING,
    experts_name,
    is_routed_expert,
    sequential_expert,
    tp_partition,
)

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
MAIN_PARAM = "main_param"
STEP = "step"


def model_key(name: str) -> str:
    return MODEL_PREFIX + name


def optim_key(name: str, kind: str) -> str:
    """`optim.<name>.<kind>`: kind is main_param (the fp32 main copy, bf16/fp16 models only),
    exp_avg / exp_avg_sq (Adam's moments, shaped like the parameter), momentum_buffer (SGD with
    momentum > 0) or step (Adam's 0-d step count; every parameter steps together; SGD stores 0)."""
    return f"{OPTIM_PREFIX}{name}.{kind}"


def split_key(key: str) -> tuple[str, str | None]:
    """(parameter name, optimizer kind or None) of a model.* / optim.* key."""
    if key.startswith(MODEL_PREFIX):
        return key[len(MODEL_PREFIX):], None
    assert key.startswith(OPTIM_PREFIX), key
    name, kind = key[len(OPTIM_PREFIX):].rsplit(".", 1)
    return name, kind


def is_tied_copy(name: str, param) -> bool:
    """The last stage's copy of the first stage's word embedding: a tied output layer, or the
    embedding multi-token prediction keeps there (`embedding_copy`); the first stage writes it."""
    if not getattr(param, "shared_embedding", False):
        return False
    return name == OUTPUT_LAYER or (name == WORD_EMBEDDING and getattr(param, "embedding_copy", False))


def stored_name(name: str, param) -> str:
    """The name a parameter is stored under. The tied output layer (`output_layer.weight` of a last
    stage whose embedding is shared) is not stored: it is the word embedding, gets the same gradient
    and so the same Adam state, and reads `embedding.word_embeddings.weight`."""
    return WORD_EMBEDDING if is_tied_copy(name, param) else name


def strided_shape(shape: tuple[int, ...], dim: int, stride: int) -> tuple[int, ...]:
    """`shape` with dim split into (stride, shape[dim] / stride): the stored view of a strided tensor.
    Megatron's partition_stride s > 1 (SwiGLU's packed fc1 [gate; up], whose TP rank r holds
    [gate_r; up_r]) is stored with the s blocks on a leading axis, [2f, h] -> [2, f, h], so each
    rank's TP block is one rectangle (offset r * f / tp on dim 1)."""
    if stride == 1:
        return tuple(shape)
    return (*shape[:dim], stride, shape[dim] // stride, *shape[dim + 1:])


# ---- full tensors (conversion, generation: one process, TP = 1; splits: keys.TP_SPLITS) ----------
def strided_dim(name: str, swiglu: bool) -> int | None:
    """The dim a strided parameter's blocks split (0; 1 for grouped experts [E, 2f, h]), None when
    it is not strided."""
    split = tp_partition(name, swiglu)
    return split[0] if split is not None and split[1] > 1 else None


def to_stored(name: str, full: torch.Tensor, model_cfg) -> torch.Tensor:
    """A full (TP=1) parameter as the checkpoint stores it (a view)."""
    dim = strided_dim(name, gated_linear_unit(model_cfg))
    return full if dim is None else full.view(strided_shape(tuple(full.shape), dim, 2))


def from_stored(name: str, stored: torch.Tensor, model_cfg) -> torch.Tensor:
    """Inverse of to_stored: [2, f, h] -> [2f, h] ([E, 2, f, h] -> [E, 2f, h]) for strided parameters."""
    dim = strided_dim(name, gated_linear_unit(model_cfg))
    return stored if dim is None else stored.flatten(dim, dim + 1)


# ---- what a rank holds --------------------------------------------------------------------------
@dataclass
class Shard:
    """This rank's part of one global tensor: boxes of it, each with the local view that holds it
    (views[i].shape == boxes[i].sizes). `write` is False for a replica whose boxes another rank
    writes (what a loader must fill is the same either way)."""

    global_shape: tuple[int, ...]
    boxes: list[Box] = field(default_factory=list)
    views: list[torch.Tensor] = field(default_factory=list)
    write: bool = True

    def __post_init__(self):
        assert len(self.boxes) == len(self.views)
        for box, view in zip(self.boxes, self.views):
            assert tuple(view.shape) == box.sizes, (box, tuple(view.shape))

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> Shard:
        """A tensor held entirely by this rank (its own global tensor)."""
        shape = tuple(tensor.shape)
        return cls(shape, [Box((0,) * len(shape), shape)], [tensor])

    def add(self, box: Box, view: torch.Tensor) -> None:
        assert tuple(view.shape) == box.sizes
        self.boxes.append(box)
        self.views.append(view)

    def numel(self) -> int:
        return sum(b.numel for b in self.boxes)


@dataclass(frozen=True)
class ParamLayout:
    """Parameter `name` (stored name) of global shape `global_shape`; this rank's TP block is
    [block_offsets, block_offsets + block_shape) in the stored view. replica: the block is
    TP-replicated and this is not TP rank 0, which writes it."""

    name: str
    global_shape: tuple[int, ...]
    block_offsets: tuple[int, ...]
    block_shape: tuple[int, ...]
    replica: bool = False

    @property
    def block_numel(self) -> int:
        return math.prod(self.block_shape)

    def boxes(self, lo: int = 0, hi: int | None = None) -> list[tuple[int, Box]]:
        """(flat start in the block, global box) covering the block's flat range [lo, hi)."""
        hi = self.block_numel if hi is None else hi
        return [(start, box.shifted(self.block_offsets))
                for start, box in flat_range_boxes(self.block_shape, lo, hi)]

    def shard(self, flat: torch.Tensor, lo: int, hi: int, into: Shard | None = None) -> Shard:
        """The Shard of the block's flat range [lo, hi), whose values `flat` (1-D, hi - lo elements,
        e.g. a distributed-optimizer shard) holds; every box is a view of `flat`. `into`: add the
        boxes to that Shard (several local tensors of one global tensor) instead of a new one."""
        assert flat.dim() == 1 and flat.numel() == hi - lo, (flat.shape, lo, hi)
        shard = into if into is not None else Shard(self.global_shape, write=not self.replica)
        for start, box in self.boxes(lo, hi):
            shard.add(box, flat[start - lo:start - lo + box.numel].view(box.sizes))
        return shard

    def whole(self, tensor: torch.Tensor, into: Shard | None = None) -> Shard:
        """The Shard of the whole TP block held by `tensor` (shaped like the local parameter)."""
        return self.shard(tensor.view(-1), 0, self.block_numel, into)


@dataclass(frozen=True)
class ExpertPlacement:
    """This rank's routed experts: global experts [first, first + E_local) of `total` (EP rank r
    holds first = r * total / EP), each split over expert-TP (etp, etp_rank); swiglu: a gated
    MLP (SwiGLU or quick-GEGLU), fc1 [gate; up] (strided). Routed experts are stored under their
    grouped names with the global expert axis first, `mlp.experts.linear_fc1.weight` [E, 2, f, h]
    (param_names.experts_name): a rank holds the rows of its experts, its expert-TP block inside
    them."""

    total: int
    first: int = 0
    etp: int = 1
    etp_rank: int = 0
    swiglu: bool = False


def expert_layout(name: str, param: torch.nn.Parameter, experts: ExpertPlacement) -> ParamLayout:
    """The layout of a routed-expert parameter (sequential [out, in] or grouped [E_local, out, in]):
    rows of the global expert axis, its ETP block (keys.TP_SPLITS) within them."""
    key, sequential = experts_name(name), sequential_expert(name)
    shape = (1, *param.shape) if sequential is not None else tuple(param.shape)
    first = experts.first + (sequential[0] if sequential is not None else 0)
    split = tp_partition(key, experts.swiglu)
    if split is None:
        return ParamLayout(key, (experts.total, *shape[1:]), (first,) + (0,) * (len(shape) - 1), shape,
                           replica=experts.etp_rank > 0)
    dim, stride = split
    block = strided_shape(shape, dim, stride)
    dim += stride > 1
    global_shape = (experts.total, *block[1:dim], block[dim] * experts.etp, *block[dim + 1:])
    offsets = tuple(first if d == 0 else experts.etp_rank * block[d] if d == dim else 0
                    for d in range(len(block)))
    return ParamLayout(key, global_shape, offsets, block)


def param_layout(name: str, param: torch.nn.Parameter, tp: int, tp_rank: int,
                 experts: ExpertPlacement | None = None) -> ParamLayout:
    """The layout of this rank's `param` (megafab's TP attributes: tensor_model_parallel,
    partition_dim, partition_stride, shared_embedding; routed experts by `experts`)."""
    if is_routed_expert(name):
        assert experts is not None, f"{name}: a routed expert needs its ExpertPlacement"
        return expert_layout(name, param, experts)
    shape = tuple(param.shape)
    key = stored_name(name, param)
    if not getattr(param, "tensor_model_parallel", False):
        return ParamLayout(key, shape, (0,) * len(shape), shape, replica=tp_rank > 0)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    block = strided_shape(shape, dim, stride)
    if stride > 1:
        dim += 1
    global_shape = (*block[:dim], block[dim] * tp, *block[dim + 1:])
    offsets = tuple(tp_rank * block[dim] if d == dim else 0 for d in range(len(block)))
    return ParamLayout(key, global_shape, offsets, block)
