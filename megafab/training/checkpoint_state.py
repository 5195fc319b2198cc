"""What a checkpoint holds, as global-shape Shards (tensors) and plain JSON/RNG values.

Tensor keys (identical in every TP/PP/DP layout, so any layout loads any other):
    model.<name>                   the parameter, global shape, this rank's TP block
    optim.<name>.main_param        fp32 main copy (only when the model is bf16/fp16)
    optim.<name>.exp_avg / .exp_avg_sq   Adam moments, parameter-shaped (global shape)
    optim.<name>.step              Adam's step count (0-d)
<name> is megatron-core's global parameter name (global layer numbers). A TP-sharded parameter
with partition_stride s > 1 (SwiGLU's packed fc1 [gate; up], rank r holding [gate_r; up_r]) is
stored under a view that puts the s blocks on a leading axis: [2*f/tp, h] -> [2, f/tp, h], global
[2, f, h] split on dim 1, so each rank's block stays rectangular.

The tied output layer on the last stage (`output_layer.weight`, a copy of the word embedding that
receives the same gradient and therefore the same Adam updates) is not stored; on load it is
filled from `embedding.word_embeddings.weight`.

Distributed optimizer: each DP rank holds main params and Adam moments for a flat range of each
parameter's TP block only. Before saving, the ranges are assembled over the DP x CP group into full
TP blocks (every DP rank contributes its range into a zero buffer; one all-reduce per kind). The
DP replicas then write identical blocks, which DCP de-duplicates. Loading reads the full TP
block and keeps this rank's range. This costs a transient copy of the TP block's optimizer
state per rank, and keeps the format identical to the non-distributed optimizer's.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from megafab.distributed.random import checkpoint_rng_state, restore_rng_state
from megafab.model.gpt import WORD_EMBEDDING
from megafab.training.checkpoint_shard import Shard

OUTPUT_LAYER = "output_layer.weight"
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def named_parameters(state) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, param) of every parameter of this rank's chunks."""
    out = []
    for chunk in state.model:
        out += list(getattr(chunk, "module", chunk).named_parameters())
    return out


def is_tied_copy(name: str, param) -> bool:
    return name == OUTPUT_LAYER and getattr(param, "shared_embedding", False)


def stored_name(name: str, param) -> str:
    """The key a parameter is stored under (the tied output layer reads the embedding's)."""
    return WORD_EMBEDDING if is_tied_copy(name, param) else name


def global_block(param: torch.nn.Parameter, tensor: torch.Tensor, tp: int, tp_rank: int) -> Shard:
    """`tensor` (shaped like this rank's `param`) as a block of the global tensor."""
    shape = tuple(param.shape)
    if not getattr(param, "tensor_model_parallel", False):
        return Shard(tensor.view(shape), shape, (0,) * len(shape))
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    if stride > 1:
        shape = shape[:dim] + (stride, shape[dim] // stride) + shape[dim + 1:]
        dim += 1
    global_shape = shape[:dim] + (shape[dim] * tp,) + shape[dim + 1:]
    offsets = tuple(tp_rank * shape[dim] if d == dim else 0 for d in range(len(shape)))
    return Shard(tensor.view(shape), global_shape, offsets)


# ---- model ---------------------------------------------------------------------------------------
def model_shards(state, for_load: bool) -> tuple[dict[str, Shard], list]:
    """model.<name> -> this rank's block, a view of the parameter (loading writes in place); and
    (param, key) pairs for parameters that must copy another's loaded key (a tied output layer
    on the rank that also holds the embedding: PP=1 with virtual chunks)."""
    topo = state.topology
    shards, aliases = {}, []
    for name, p in named_parameters(state):
        if is_tied_copy(name, p) and not for_load:
            continue
        key = "model." + stored_name(name, p)
        if key in shards:
            aliases.append((p, key))
            continue
        shards[key] = global_block(p, p.detach(), topo.tp, topo.tp_rank)
    return shards, aliases


@torch.no_grad()
def apply_aliases(shards: dict[str, Shard], aliases: list) -> None:
    for p, key in aliases:
        p.copy_(shards[key].tensor.view(p.shape))


# ---- optimizer -----------------------------------------------------------------------------------
def _entries_by_param(optimizer) -> dict:
    return {e.model_param: e for e in optimizer.entries}


def _full_blocks(state) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name: main_param (if a copy), exp_avg, exp_avg_sq (param-shaped TP blocks)
    and step (0-d), assembled over DP when the optimizer holds only flat ranges."""
    opt, topo = state.optimizer, state.topology
    entries = _entries_by_param(opt)
    named = named_parameters(state)
    sharded = any(e.param_range is not None for e in opt.entries)
    dtype = opt.entries[0].main.dtype
    has_copy = any(e.is_copy for e in opt.entries)
    kinds = ADAM_MOMENTS + (("main_param",) if has_copy else ())
    offsets, total = {}, 0
    for name, p in named:
        offsets[name] = total
        total += p.numel()
    flat = {k: torch.zeros(total, dtype=dtype, device=topo.device) for k in kinds}
    steps = torch.zeros(len(named), dtype=torch.float64, device=topo.device)
    for i, (name, p) in enumerate(named):
        e = entries.get(p)
        if e is None:
            continue
        lo, hi = e.param_range or (0, p.numel())
        base = offsets[name]
        adam = opt.optimizer.state.get(e.main, {})
        for k in ADAM_MOMENTS:
            if k in adam:
                flat[k][base + lo:base + hi] = adam[k].reshape(-1)
        if has_copy:
            flat["main_param"][base + lo:base + hi] = e.main.reshape(-1)
        if "step" in adam:
            steps[i] = float(adam["step"])
    if sharded and topo.dp * topo.cp > 1:  # the distributed optimizer shards over DP x CP
        for k in kinds:
            dist.all_reduce(flat[k], group=topo.dp_cp_group)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=topo.dp_cp_group)
    out = {}
    for i, (name, p) in enumerate(named):
        base = offsets[name]
        out[name] = {k: flat[k][base:base + p.numel()].view(p.shape) for k in kinds}
        out[name]["step"] = steps[i].to(torch.float32).cpu()
    return out


def optimizer_shards_for_save(state) -> dict[str, Shard]:
    topo = state.topology
    blocks = _full_blocks(state)
    shards = {}
    for name, p in named_parameters(state):
        if is_tied_copy(name, p) or not p.requires_grad:
            continue
        for kind, tensor in blocks[name].items():
            shards[f"optim.{name}.{kind}"] = Shard.whole(tensor) if kind == "step" else \
                global_block(p, tensor, topo.tp, topo.tp_rank)
    return shards


def optimizer_shards_for_load(state, with_main: bool) -> tuple[dict[str, Shard], list]:
    """Empty param-shaped buffers to read into, and what to do with them afterwards."""
    topo, opt = state.topology, state.optimizer
    entries = _entries_by_param(opt)
    shards, plan = {}, []
    for name, p in named_parameters(state):
        e = entries.get(p)
        if e is None:
            continue
        key = stored_name(name, p)
        kinds = ADAM_MOMENTS + (("main_param",) if (with_main and e.is_copy) else ())
        buffers = {}
        for kind in kinds + ("step",):
            full_key = f"optim.{key}.{kind}"
            if full_key not in shards:  # else a tied copy on this rank reads the same key
                empty = torch.zeros((), dtype=torch.float32) if kind == "step" else \
                    torch.empty(p.shape, dtype=e.main.dtype, device=topo.device)
                shards[full_key] = Shard.whole(empty) if kind == "step" else \
                    global_block(p, empty, topo.tp, topo.tp_rank)
            buffers[kind] = shards[full_key].tensor
        plan.append((e, buffers))
    return shards, plan


def _scalar_dtype(fused: bool) -> torch.dtype:
    """torch.optim's dtype for Adam's step (see torch.optim.optimizer._get_scalar_dtype)."""
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@torch.no_grad()
def apply_optimizer_blocks(state, plan: list) -> None:
    """Keep this rank's flat range of every loaded block as its main param and Adam state."""
    opt = state.optimizer
    fused = bool(opt.optimizer.defaults.get("fused"))
    for e, buffers in plan:
        lo, hi = e.param_range or (0, e.model_param.numel())
        ranged = {k: v.reshape(-1)[lo:hi].view(e.main.shape) for k, v in buffers.items() if k != "step"}
        if "main_param" in ranged:
            e.main.copy_(ranged["main_param"])
        step_device = e.main.device if fused else torch.device("cpu")
        opt.optimizer.state[e.main] = {
            "step": torch.tensor(float(buffers["step"]), dtype=_scalar_dtype(fused), device=step_device),
            **{k: ranged[k].clone() for k in ADAM_MOMENTS}}


@torch.no_grad()
def refresh_main_params(state) -> None:
    """Main copies (bf16/fp16 models) take the freshly loaded model weights."""
    for e in state.optimizer.entries:
        if e.is_copy:
            e.main.copy_(e.model_values().to(e.main.dtype))


# ---- RNG -----------------------------------------------------------------------------------------
def rng_snapshot(state) -> dict:
    """Every random stream of this rank, as plain lists/ints and CPU tensors (weights_only-safe)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    snap = checkpoint_rng_state(state.tracker, state.topology.device)
    return {"python": [version, list(internal), gauss],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
            "torch": snap}


def restore_rng(state, snap: dict) -> None:
    version, internal, gauss = snap["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = snap["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    restore_rng_state(snap["torch"], state.tracker, state.topology.device)
