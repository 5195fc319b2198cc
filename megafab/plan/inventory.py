"""What a model holds, read off the engine: each distinct part of a model (a transformer layer of each
kind, a chunk's embedding and output ends) is built once on the meta device with megafab.model's own
classes at one rank's TP / ETP / EP sizes (SizedGroup stands in for the process groups), and the
planner, FLOPs, optimizer-tensor counts and checkpoint keys take from it each parameter's name, shape
and roles, the state-dict keys and FSDP2's units (megafab.distributed.fsdp's own rules). Nothing here
lists what a layer holds: a parameter or part added to the model is counted as it is built.

Layers of one kind differ only in their number (the config's MoE pattern chooses the kind, as the
model's build_mlp does): one is built and renamed. Builds are cached per (model and MoE settings,
sizes), so the layout search builds each part once per layout it sizes. The settings that choose how
a layer runs (recompute, Transformer Engine, torch.compile) are left out of that key and the local
layer is built: TE's holds the same parameters under other names.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from megafab.distributed.fsdp import expert_units, layer_units
from megafab.distributed.sized_group import SizedGroup
from megafab.model.gpt import GPTModel
from megafab.model.transformer import LayerContext
from megafab.param_names import layer_module, renumber

_HOW_IT_RUNS = ("recompute_", "transformer_impl", "compile_layers")  # model fields (prefixes)


@dataclass(frozen=True)
class Tensor:
    """One parameter as the model registers it on a rank."""
    name: str  # the model's name, global layer number
    shape: tuple[int, ...]
    expert: bool = False  # param.is_expert: a routed expert's, reduced over expert-DP
    shared_embedding: bool = False  # a tied word-embedding weight (either stage's copy)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, eq=False)
class Part:
    """Parameters (in registration order) and state-dict keys of a built part on one rank."""
    tensors: tuple[Tensor, ...]
    keys: tuple[str, ...] = ()  # parameters and persistent buffers (an MoE router's expert_bias)
    units: tuple[tuple[int, int], ...] = ()  # a layer's FSDP2 groups, (dense, expert) parameters each
    local_experts: int = 0  # routed experts the rank holds (an MoE layer)
    total: int = dataclasses.field(init=False)  # parameters
    expert: int = dataclasses.field(init=False)  # routed-expert parameters among them

    def __post_init__(self):
        object.__setattr__(self, "total", sum(t.numel for t in self.tensors))
        object.__setattr__(self, "expert", sum(t.numel for t in self.tensors if t.expert))

    def renumbered(self, delta: int) -> Part:
        """The same part moved `delta` layers on (another layer of its kind)."""
        if delta == 0:
            return self
        tensors = tuple(dataclasses.replace(t, name=renumber(t.name, delta)) for t in self.tensors)
        return Part(tensors, tuple(renumber(k, delta) for k in self.keys), self.units, self.local_experts)


@dataclass(frozen=True, eq=False)
class Ends:
    """A chunk's parts other than its layers: `head` registered before them (the embedding), `tail`
    after (the final norm, the output layer)."""
    head: Part
    tail: Part

    @property
    def total(self) -> int:
        return self.head.total + self.tail.total

    @property
    def keys(self) -> tuple[str, ...]:
        return self.head.keys + self.tail.keys


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


_KEYS: dict[int, tuple] = {}  # id(frozen section) -> (weakref to it, its key)


def _key(section, skip: tuple[str, ...] = ()) -> tuple:
    """The section's values as a hashable key; a frozen (finalized) section's is computed once."""
    known = _KEYS.get(id(section))
    if known is not None and known[0]() is section:
        return known[1]
    key = tuple(_hashable(getattr(section, f.name)) for f in dataclasses.fields(section)
                if not f.name.startswith(skip))
    if getattr(section, "frozen", False):
        _KEYS[id(section)] = (weakref.ref(section), key)  # a dead entry is never matched, then replaced
    return key


_DIVISIONS = {torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.true_divide,
              torch.Tensor.__truediv__, torch.Tensor.__rtruediv__}
_OPS = ("add", "sub", "mul", "pow")
_ARITHMETIC = _DIVISIONS | {getattr(owner, op) for owner in (torch, torch.Tensor) for op in _OPS} \
    | {getattr(torch.Tensor, f"__{r}{op}__") for op in _OPS for r in ("", "r")}


def _broadcast(*shapes) -> list[int]:
    """Broadcast shapes (torch.broadcast_shapes imports sympy, a second)."""
    out = [1] * max(len(s) for s in shapes)
    for shape in shapes:
        for i, n in enumerate(shape, len(out) - len(shape)):
            out[i] = n if out[i] == 1 else out[i]
    return out


def _meta_shape(func, args, kwargs) -> torch.Tensor | None:
    """The empty meta result of cat, stack, arange or binary arithmetic on meta tensors (torch.nn.init's
    fills: the tensor as it is); None for any other call (or one on another device)."""
    if getattr(func, "__module__", None) == "torch.nn.init":  # in-place fills: a meta tensor has no values
        target = kwargs.get("tensor", args[0] if args else None)
        return target if isinstance(target, torch.Tensor) and target.is_meta else None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if "out" in kwargs or not args:
        return None
    if func in (torch.cat, torch.stack):
        parts, dim = list(args[0]), args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if not parts or not all(t.is_meta for t in parts):
            return None
        shape = list(parts[0].shape)
        if func is torch.stack:
            shape.insert(dim % (len(shape) + 1), len(parts))
        else:
            shape[dim % len(shape)] = sum(t.shape[dim] for t in parts)
        return torch.empty(shape, dtype=parts[0].dtype, device="meta")
    if func is torch.arange and torch.device(kwargs.get("device") or "meta").type == "meta":
        start, end, step = (float(b) for b in ([0, *args, 1] if len(args) == 1 else [*args, 1][:3]))
        length = max(0, math.ceil((end - start) / step))
        return torch.empty(length, dtype=kwargs.get("dtype") or torch.get_default_dtype(), device="meta")
    if func in _ARITHMETIC and len(args) == 2 and not kwargs and tensors and all(t.is_meta for t in tensors):
        dtype = torch.result_type(*args)
        if func in _DIVISIONS and not dtype.is_floating_point:
            dtype = torch.get_default_dtype()
        return torch.empty(_broadcast(*(t.shape for t in tensors)), dtype=dtype, device="meta")
    return None


class _MetaShapes(TorchFunctionMode):
    """Concatenation, arange and arithmetic on the meta device answered with an empty meta tensor of
    the result's shape and dtype: torch's meta kernels for them are Python that imports torch._dynamo
    on first use (2 s per process; only that time is at stake if another such op joins the build)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _meta_shape(func, args, kwargs)
        return func(*args, **kwargs) if out is None else out


def _tensor(name: str, p: torch.nn.Parameter) -> Tensor:
    return Tensor(name, tuple(p.shape), getattr(p, "is_expert", False), getattr(p, "shared_embedding", False))


def _fsdp_units(layer: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """(dense, expert) parameters of each FSDP2 group of a layer, as FullyShardedDataParallel shards
    them (the routed experts first, then layer_units; a parameter belongs to the first group holding
    it), listed as the layer itself (its norms), its sub-blocks, its routed experts."""
    experts = expert_units(layer)
    blocks = [u for u in layer_units([layer]) if all(u is not e for e in experts)]
    owner: dict[int, int] = {}
    for i, unit in enumerate([*experts, *blocks]):
        for p in unit.parameters():
            owner.setdefault(id(p), i)
    counts = [[0, 0] for _ in range(len(experts) + len(blocks))]
    for p in layer.parameters():
        counts[owner[id(p)]][getattr(p, "is_expert", False)] += p.numel()
    ordered = counts[-1:] + counts[len(experts):-1] + counts[:len(experts)]
    return tuple((dense, expert) for dense, expert in ordered)


class Inventory:
    """The parts of one model on a rank of TP `tp`, ETP `etp`, EP `ep` (m: the model config, moe: the
    MoE settings or None)."""

    _built: dict[tuple, Part | Ends] = {}  # shared by every Inventory: (key, part) -> what was built

    def __init__(self, m, moe=None, tp: int = 1, etp: int = 1, ep: int = 1):
        if moe is not None and moe.num_experts is None:  # a dense model's (empty) MoE section
            moe = None
        if moe is None:
            etp = ep = 1
        self.m, self.moe, self.sizes = m, moe, (tp, etp, ep)
        self.key = (_key(m, _HOW_IT_RUNS), None if moe is None else _key(moe), tp, etp, ep)
        self._kinds: dict[bool, int] = {}
        self._parts: dict[tuple, Part | Ends] = {}  # this instance's lookups of _built

    def _kind(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index)

    def layer(self, index: int) -> Part:
        """Global layer `index` (the part built for its kind: its names may be another layer's)."""
        kind = self._kind(index)
        if kind not in self._kinds:
            self._kinds[kind] = next(i for i in range(self.m.num_layers) if self._kind(i) == kind)
        first = self._kinds[kind]
        return self._get(("layer", kind), lambda: self._layer(first))

    def named_layer(self, index: int) -> Part:
        """Global layer `index` under its own names."""
        part = self.layer(index)
        return part.renumbered(index - self._kinds[self._kind(index)])

    def ends(self, pre_process: bool, post_process: bool) -> Ends:
        """A chunk's embedding (pre_process) and final norm and output layer (post_process), built
        without the MoE settings and expert groups (only layers read them): one per TP size. The
        last chunk's multi-token prediction layers (the embedding copy and mtp.layers.*, in the
        tail) are layers: built with them."""
        mtp = post_process and bool(self.m.mtp_num_layers)
        return self._get(("ends", pre_process, post_process),
                         lambda: self._ends(pre_process, post_process, mtp),
                         None if mtp else (self.key[0], self.sizes[0]))

    def _get(self, what: tuple, build, shared_by: tuple | None = None):
        """What `build` makes, built once for every Inventory of the same `shared_by` (default: the
        same model, MoE settings and sizes)."""
        if what not in self._parts:
            key = (self.key if shared_by is None else shared_by, what)
            if key not in self._built:
                self._built[key] = build()
            self._parts[what] = self._built[key]
        return self._parts[what]

    def _model(self, first: int, last: int, pre_process: bool, post_process: bool,
               experts: bool = True) -> GPTModel:
        tp, etp, ep = self.sizes
        groups = {}
        if self.moe is not None and experts:
            groups = dict(moe=self.moe, ep_group=SizedGroup(ep), etp_group=SizedGroup(etp),
                          tp_ep_group=SizedGroup(etp * ep))
        ctx = LayerContext(SizedGroup(tp) if tp > 1 else None, False, torch.float32, torch.device("meta"), 0,
                           **groups)
        m = self.m
        if m.transformer_impl != "local" or m.compile_layers:
            m = m.replaced(transformer_impl="local", compile_layers=False)
        with torch.device("meta"), _MetaShapes():
            return GPTModel(m, ctx, first, last, pre_process, post_process)

    def _layer(self, index: int) -> Part:
        model = self._model(index, index + 1, False, False)
        layer = model.get_submodule(layer_module(index))
        tensors = tuple(_tensor(f"{layer_module(index)}.{n}", p) for n, p in layer.named_parameters())
        local = getattr(getattr(layer.mlp, "dispatcher", None), "num_local_experts", 0)
        return Part(tensors, tuple(model.state_dict()), _fsdp_units(layer), local)

    def _ends(self, pre_process: bool, post_process: bool, experts: bool = False) -> Ends:
        model = self._model(0, 0, pre_process, post_process, experts=experts)
        children = [name for name, _ in model.named_children()]
        layers_at = children.index("decoder")  # decoder.layers is the decoder's first child
        before = {name for name in children[:layers_at]}
        head, tail = [], []
        for name, p in model.named_parameters():
            (head if name.split(".")[0] in before else tail).append(_tensor(name, p))
        keys = list(model.state_dict())
        head_keys = tuple(k for k in keys if k.split(".")[0] in before)
        tail_keys = tuple(k for k in keys if k not in head_keys)
        return Ends(Part(tuple(head), head_keys), Part(tuple(tail), tail_keys))
