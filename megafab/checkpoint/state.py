"""A training state's checkpoint pieces: model weights and optimizer state as Shards, RNG streams.

Writing: of each parameter, a rank writes the flat range of its TP block it owns (its DDP bucket
share or its FSDP2 dim-0 shard): the weights, and the main param and moments of that range. DP
ranks write disjoint boxes, so the bytes each writes fall as 1/DP (write_plan). Reading: every
rank reads only what it will hold, straight into its parameters or flat optimizer shards, and no
rank allocates a parameter-shaped temporary (model_shards_for_load, optimizer_shards_for_load).

The stored tensors are the same whichever optimizer, DP size, FSDP2 or TP/PP/VPP layout saved
them: weights in the model dtype, fp32 main params only for bf16/fp16 models (`has_master`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from megafab.checkpoint.boxes import Box
from megafab.checkpoint.layout import (
    MAIN_PARAM,
    STEP,
    ExpertPlacement,
    ParamLayout,
    Shard,
    is_tied_copy,
    model_key,
    optim_key,
    param_layout,
)
from megafab.distributed.fsdp import is_fully_sharded, local_tensor
from megafab.distributed.random import checkpoint_rng_state, restore_rng_state
from megafab.model.activations import gated_linear_unit
from megafab.model.fp8_params import dequantized, is_fp8_param
from megafab.param_names import EXPERT_BIAS, mtp_split_key, parse_index


def expert_placement(state) -> ExpertPlacement | None:
    """Where this rank's routed experts sit on the global expert axis (None: a dense model)."""
    moe = getattr(state.cfg, "moe", None)
    if moe is None or moe.num_experts is None:
        return None
    topo = state.topology
    ep, etp = topo.size("ep"), topo.size("etp")
    return ExpertPlacement(moe.num_experts, topo.coord("ep") * (moe.num_experts // ep), etp,
                           topo.coord("etp"), gated_linear_unit(state.cfg.model))


def _layout(state, name: str, p) -> ParamLayout:
    topo = state.topology
    return param_layout(name, p, topo.tp, topo.tp_rank, expert_placement(state))


def checkpointed_buffers(state) -> list[tuple[str, torch.Tensor]]:
    """(global name, buffer) of the buffers a checkpoint keeps: each MoE router's expert_bias (the
    same on every rank of its stage: updated from all-reduced token counts; an MoE MTP layer's
    too), written by TP/DP/CP rank 0 and read whole by every rank."""
    out = []
    for chunk in state.model:
        for name, buf in getattr(chunk, "module", chunk).named_buffers():
            parsed = parse_index(name)
            suffix = parsed[1] if parsed is not None else mtp_split_key(name)
            if buf is not None and suffix == EXPERT_BIAS:
                out.append((name, buf))
    return out


def _buffer_writer(state) -> bool:
    topo = state.topology
    return topo.tp_rank == 0 and topo.dp_rank == 0 and topo.cp_rank == 0


def named_parameters(state) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, param) of every parameter of this rank's chunks."""
    out = []
    for chunk in state.model:
        out += list(getattr(chunk, "module", chunk).named_parameters())
    return out


def dp_owned_ranges(chunks) -> dict[torch.nn.Parameter, tuple[int, int]]:
    """Per parameter, the flat range of it this rank owns: its DDP shard of every bucket, or its
    FSDP2 shard; the whole parameter when it is in no bucket (frozen, or a chunk without DDP).
    Absent: owns none of it."""
    ranges = {}
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        sharded = set(chunk.params) if hasattr(chunk, "owned_param_ranges") else set()
        ranges.update({p: (0, p.numel()) for p in module.parameters() if p not in sharded})
        if sharded:
            ranges.update(chunk.owned_param_ranges())
    return ranges


def owned_values(param: torch.nn.Parameter, lo: int, hi: int) -> torch.Tensor:
    """The flat [lo, hi) of `param` this rank holds, as a view (an FSDP2 DTensor's local shard is
    exactly its owned range)."""
    local = local_tensor(param)
    if is_fp8_param(local):  # TE's FP8 weight (an FSDP2 shard's local one): a dequantized copy
        if local is not param:
            return dequantized(local).view(-1)
        values = dequantized(param).view(-1)[lo:hi]
        return values.clone() if hi - lo < param.numel() else values
    if local is not param:
        return local.view(-1)
    return param.detach().view(-1)[lo:hi]


def _compute_dtypes(state) -> dict:
    """FSDP2 parameters whose shards are stored in a higher precision than the model computes in
    (the fp32 masters of a bf16/fp16 model) -> the model dtype."""
    out = {}
    for chunk in state.model:
        if is_fully_sharded(chunk) and chunk.main_dtype != chunk.compute_dtype:
            out.update({p: chunk.compute_dtype for p in chunk.params})
    return out


@dataclass(frozen=True)
class Written:
    """The flat range [lo, hi) of parameter `param`'s TP block that this rank writes."""

    name: str
    param: torch.nn.Parameter
    layout: ParamLayout
    lo: int
    hi: int


def write_plan(named, ranges: dict, tp: int, tp_rank: int,
               experts: ExpertPlacement | None = None) -> list[Written]:
    """What a rank writes of each parameter: its owned range, nothing of a tied copy or of a
    TP-replicated block on TP rank > 0 (an ETP-replicated one on ETP rank > 0). A pure function of
    the layout.

    The owned range is DDP's bucket layout (DP rank r owns the r-th 1/DP of every bucket, whichever
    optimizer runs), or under FSDP2 the dim-0 shard (rows [r * c, (r + 1) * c) of the block, a flat
    range too). A routed expert's parameter is laid out on the global expert axis (its EP position
    gives its experts' rows, its expert-TP rank the block within them) and its owned range is the
    expert-DP one (DDP's expert buckets carry that group). Adam's `step` is the same for every
    parameter, so no collective is needed: whoever writes element 0 of a TP block writes it."""
    out = []
    for name, p in named:
        if is_tied_copy(name, p) or p not in ranges:
            continue
        layout = param_layout(name, p, tp, tp_rank, experts)
        if not layout.replica:
            out.append(Written(name, p, layout, *ranges[p]))
    return out


def _state_write_plan(state) -> list[Written]:
    topo = state.topology
    return write_plan(named_parameters(state), dp_owned_ranges(state.model), topo.tp, topo.tp_rank,
                      expert_placement(state))


def _add(shards: dict[str, Shard], key: str, layout: ParamLayout, flat: torch.Tensor, lo: int, hi: int):
    """Boxes of several local tensors of one key (a tied copy on the embedding's rank, the
    sequential experts of one layer) share a Shard."""
    shards[key] = layout.shard(flat, lo, hi, into=shards.get(key))


# ---- save ----------------------------------------------------------------------------------------
def model_shards_for_save(state) -> dict[str, Shard]:
    """model.<name> -> this rank's owned boxes, views of the parameter (a model-dtype copy of an
    FSDP2 master shard: a bf16/fp16 FSDP2 shard *is* the fp32 master, so its weights are written as
    a model-dtype copy of this rank's rows only)."""
    compute = _compute_dtypes(state)
    shards = {}
    for w in _state_write_plan(state):
        values = owned_values(w.param, w.lo, w.hi)
        if w.param in compute:
            values = values.to(compute[w.param])
        _add(shards, model_key(w.layout.name), w.layout, values, w.lo, w.hi)
    for name, buf in checkpointed_buffers(state):
        shards[model_key(name)] = Shard.whole(buf)
        shards[model_key(name)].write = _buffer_writer(state)
    return shards


def _entries_by_param(optimizer) -> dict:
    return {e.model_param: e for e in optimizer.entries}


def _entry_range(e) -> tuple[int, int]:
    return e.param_range or (0, e.model_param.numel())


def common_step(optimizer) -> torch.Tensor:
    """Adam's step, the same for every parameter (0 before the first step, and for SGD), as a 0-d
    tensor."""
    for inner in optimizer.torch_optimizers:
        for state in inner.state.values():
            if "step" in state:
                return torch.tensor(float(state["step"]), dtype=torch.float32)
    return torch.tensor(0.0)


def optimizer_shards_for_save(state) -> dict[str, Shard]:
    """optim.<name>.<kind> -> this rank's owned boxes, views of its main params and the optimizer's
    moments (Adam exp_avg, exp_avg_sq; SGD momentum_buffer)."""
    opt = state.optimizer
    entries = _entries_by_param(opt)
    step = common_step(opt)
    shards = {}
    for w in _state_write_plan(state):
        e = entries.get(w.param)
        if e is None:  # frozen
            continue
        e_lo, e_hi = _entry_range(e)
        assert e_lo <= w.lo and w.hi <= e_hi, (w.name, (e_lo, e_hi), (w.lo, w.hi))
        kept = opt.torch_optimizer_of(e).state.get(e.main, {})
        tensors = {k: kept[k] if kept.get(k) is not None else torch.zeros_like(e.main)
                   for k in opt.state_keys}
        if e.has_master:
            tensors[MAIN_PARAM] = e.main
        for kind, t in tensors.items():
            flat = t.view(-1)[w.lo - e_lo:w.hi - e_lo]
            _add(shards, optim_key(w.layout.name, kind), w.layout, flat, w.lo, w.hi)
        if w.lo == 0:
            shards[optim_key(w.layout.name, STEP)] = Shard.whole(step)
    return shards


# ---- load ----------------------------------------------------------------------------------------
def model_shards_for_load(state, masters_from_main: bool) -> tuple[dict[str, Shard], list]:
    """Views of the parameters to read into, and the DDP chunks to all-gather afterwards.
    masters_from_main: FSDP2 master shards are read with the optimizer state (from the checkpoint's
    fp32 main params), not from the weights.

    With the distributed optimizer each rank reads its own range into DDP's parameter buffer and
    the buckets are all-gathered over DP (gather_params), as after an optimizer step; otherwise
    each rank reads its TP block in place. FSDP2 ranks read their own shards and nothing is
    gathered (FSDP2 gathers at the next forward)."""
    shards, gather = {}, []
    compute = _compute_dtypes(state) if masters_from_main else {}
    for chunk in state.model:
        gathered = getattr(chunk, "param_buffer", None) is not None  # distributed optimizer
        sharded = gathered or is_fully_sharded(chunk)
        ranges = dp_owned_ranges([chunk]) if sharded else {}
        module = getattr(chunk, "module", chunk)
        # FP8 weights: read into copies, cast into the param buffer before the gather; from the
        # checkpoint's main params when it has them (the step's own cast: the weights resume exactly)
        with_mains = masters_from_main and state.optimizer is not None
        fp8, mains = {}, {e.model_param: e.main for e in state.optimizer.entries} if with_mains else {}
        has_fp8 = any(is_fp8_param(local_tensor(p)) for p in module.parameters())
        for name, p in module.named_parameters():
            lo, hi = ranges.get(p, (0, 0)) if sharded else (0, p.numel())
            is_fp8 = is_fp8_param(local_tensor(p)) and lo < hi
            if p in compute:  # an FSDP2 master shard, read with the optimizer state
                if is_fp8 and p in mains:
                    fp8[p] = mains[p]
                continue
            layout = _layout(state, name, p)
            values = owned_values(p, lo, hi)
            if is_fp8:
                fp8[p] = mains.get(p, values)
            _add(shards, model_key(layout.name), layout, values, lo, hi)
        if has_fp8:  # every DP rank casts (a collective), also one that owns none of them
            chunk.load_fp8_shards(fp8)
        if gathered or has_fp8:
            gather.append(chunk)
    shards.update({model_key(name): Shard.whole(buf) for name, buf in checkpointed_buffers(state)})
    return shards, gather


def gather_params(chunks) -> None:
    """Every DP rank read its own range of the weights: all-gather the buckets over DP (an FSDP2
    chunk: its FP8 shards read are cast; FSDP2 gathers at the next forward)."""
    for chunk in chunks:
        if is_fully_sharded(chunk):
            chunk.apply_fp8_loads()
            continue
        chunk.start_param_sync()
        chunk.finish_param_sync()


@dataclass
class OptimizerTargets:
    """Where one optimizer entry's state is read to: its own (new) tensors, and its main param."""

    entry: object
    moments: dict[str, torch.Tensor]
    step: torch.Tensor
    main_loaded: bool


def optimizer_shards_for_load(state, with_main: bool) -> tuple[dict[str, Shard], list[OptimizerTargets]]:
    """Fresh optimizer moments shaped like each entry's main param (its own shard under the
    distributed optimizer), the main params themselves (when the checkpoint has fp32 mains and this
    model copies), and a 0-d step per entry, as Shards to read into."""
    opt = state.optimizer
    entries = _entries_by_param(opt)
    shards, targets = {}, []
    for name, p in named_parameters(state):
        e = entries.get(p)
        if e is None:
            continue
        layout = _layout(state, name, p)
        lo, hi = _entry_range(e)
        moments = {k: torch.empty_like(e.main) for k in opt.state_keys}
        reads = dict(moments)
        main_loaded = with_main and e.has_master
        if main_loaded:
            reads[MAIN_PARAM] = e.main
        for kind, t in reads.items():
            _add(shards, optim_key(layout.name, kind), layout, t.view(-1), lo, hi)
        step = torch.zeros(())
        shards.setdefault(optim_key(layout.name, STEP), Shard(())).add(Box((), ()), step)
        targets.append(OptimizerTargets(e, moments, step, main_loaded))
    return shards, targets


def _scalar_dtype(fused: bool) -> torch.dtype:
    """torch.optim's dtype for Adam's step (see torch.optim.optimizer._get_scalar_dtype)."""
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def apply_optimizer_state(state, targets: list[OptimizerTargets]) -> None:
    """The loaded tensors become the optimizer's state (no copies)."""
    opt = state.optimizer
    for t in targets:
        inner = opt.torch_optimizer_of(t.entry)
        fused = bool(inner.defaults.get("fused"))
        loaded = dict(t.moments)
        if opt.optimizer_name == "adam":  # torch SGD keeps no step count
            step_device = t.entry.main.device if fused else torch.device("cpu")
            loaded["step"] = torch.tensor(float(t.step), dtype=_scalar_dtype(fused), device=step_device)
        inner.state[t.entry.main] = loaded


@torch.no_grad()
def refresh_main_params(state, skip: set | None = None) -> None:
    """Main copies (bf16/fp16 models, offloaded mains) take the loaded model weights, except the
    entries in `skip` (whose fp32 mains were read from the checkpoint)."""
    skip = skip or set()
    for e in state.optimizer.entries:
        if e.is_copy and id(e) not in skip:
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
