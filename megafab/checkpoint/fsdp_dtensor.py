"""Megatron-LM's fsdp_dtensor checkpoint (--ckpt-format fsdp_dtensor, Megatron-FSDP's): read, written.

One torch DCP directory (.metadata, __R_0.distcp; no metadata.json, no common.pt): Megatron's state
dict flattened by DCP (nested keys joined by '.'), every tensor under its global (TP=1) shape:
  model.module.<path>      weights, one key per layer (decoder.layers.N.*, N of the whole model), the
                           live modules' paths (TE: linear_qkv.layer_norm_weight); SwiGLU fc1 [2f, h]
                           as `.weight_w` gate [f, h] + `.weight_v` up [f, h]; routed experts one per
                           global index (fsdp_dtensor_keys.py); no `_extra_state` (Megatron drops them)
  optimizer.state.{P}<path>.exp_avg / .exp_avg_sq    Adam's moments, the weight's shape (fp32)
  optimizer.state.{P}<path>.step                     0-d: torch.optim's Adam only (read if there)
  optimizer.param_to_group_meta.{P}<path>.<k>        bytes: the group's lr, weight_decay, betas, eps,
                           ..., and FusedAdam's `step` (Adam's step count); fc1 unsplit (no _w / _v)
  args (Namespace), checkpoint_version (3.0), iteration, num_floating_point_operations_so_far,
  opt_param_scheduler.<k> (max_lr, lr_warmup_steps, num_steps, ...: samples), rng_state.(<pp>, <tp>).
  <dp>.* (CUDA generator states), rerun_state_machine.*     bytes
{P}: 'module.module.' (DDP wrapper, MegatronFSDP), 'module.module.module.' with Float16Module (--bf16/
--fp16, whose state_dict adds none to the weights'); any depth is read. The weights are the fp32 main
params where the model is 16-bit. megafab writes all of it but rng_state / rerun_state_machine, plus
its own record (`megafab`) and RNG files (rng/rank_*.pt), which Megatron ignores (--no-load-rng).
"""

from __future__ import annotations

import torch

from megafab.checkpoint import fsdp_dtensor_keys as fk
from megafab.checkpoint import megatron_dist, safe_pickle
from megafab.checkpoint import megatron_keys as mk
from megafab.checkpoint import strictness as strict_load
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import (
    MAIN_PARAM,
    MODEL_PREFIX,
    STEP,
    Shard,
    is_tied_copy,
    model_key,
    optim_key,
    param_layout,
    split_key,
    strided_dim,
)
from megafab.checkpoint.megatron_args import flat_from_args, megatron_namespace
from megafab.checkpoint.source import CheckpointSource, counters_from_common
from megafab.checkpoint.state import expert_placement, named_parameters
from megafab.model.activations import gated_linear_unit
from megafab.param_names import is_routed_expert

FORMAT = "fsdp_dtensor"
SCHEDULER = "opt_param_scheduler."
MEGAFAB = "megafab"
CHECKPOINT_VERSION = 3.0
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


# ---- save ----------------------------------------------------------------------------------------
def to_fsdp(shards: dict[str, Shard], cfg) -> dict[str, Shard]:
    """megafab-keyed Shards (model.* / optim.*) as fsdp_dtensor's, the same views. A parameter with an
    fp32 main copy is written from it (Megatron-FSDP's weights are its main params); Adam's step goes
    to param_to_group_meta (group_meta_objects), as Megatron's FusedAdam keeps it."""
    swiglu = gated_linear_unit(cfg.model)
    mains = {split_key(k)[0] for k in shards if split_key(k)[1] == MAIN_PARAM}
    out: dict[str, Shard] = {}
    for key, shard in shards.items():
        name, kind = split_key(key)
        if kind == STEP or (kind is None and name in mains):
            continue
        prefix, suffix = (fk.model_prefix(cfg), "") if kind in (None, MAIN_PARAM) else \
            (fk.optim_prefix(cfg), "." + kind)
        for (expert, half), shape, box, view in fk.pieces(name, shard, swiglu):
            path = prefix + fk.module_path(name, cfg, expert, half) + suffix
            out.setdefault(path, Shard(shape, write=shard.write)).add(box, view)
    return out


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def group_meta_objects(state, step: float) -> dict:
    """param_to_group_meta: each parameter's optimizer group (its plain settings and Adam's step),
    written by the rank that writes the start of the parameter's block. Keyed by the parameter's own
    name (routed experts per global index): Megatron splits SwiGLU's fc1 into `_w` / `_v` in
    optimizer.state only (handle_swiglu_in_state_dict), never in param_to_group_meta. The settings
    are megafab's torch optimizer's, not Megatron's whole group (no max_lr, min_lr, is_expert_parallel,
    default_config, is_decoupled_lr), so Megatron's strict DCP load (its default) of a megafab save's
    optimizer stops on those keys: Megatron reads it with --no-strict-fsdp-dtensor-load."""
    cfg, opt, topo = state.cfg, state.optimizer, state.topology
    experts = expert_placement(state)
    entries, out = {e.model_param: e for e in opt.entries}, {}
    for name, p in named_parameters(state):
        e = entries.get(p)
        layout = param_layout(name, p, topo.tp, topo.tp_rank, experts)
        if e is None or is_tied_copy(name, p) or layout.replica or (e.param_range or (0, 0))[0] != 0:
            continue
        groups = opt.torch_optimizer_of(e).param_groups
        group = next(g for g in groups if any(q is e.main for q in g["params"]))
        meta = {k: v for k, v in group.items() if k != "params" and _plain(v)}
        meta["step"] = int(step)
        first, count = layout.block_offsets[0], layout.block_shape[0]
        routed = range(first, first + count) if is_routed_expert(layout.name) else [None]
        for expert in routed:
            path = fk.group_meta_prefix(cfg) + fk.module_path(layout.name, cfg, expert)
            out.update({f"{path}.{k}": v for k, v in meta.items()})
    return out


def common_objects(cfg, record, scheduler_state: dict | None) -> dict:
    """Rank 0's byte objects: args, counters, schedule, megafab's record."""
    objects = {"args": megatron_namespace(cfg, record, FORMAT), "checkpoint_version": CHECKPOINT_VERSION,
               "iteration": record.iteration,
               "num_floating_point_operations_so_far": record.num_floating_point_operations_so_far,
               MEGAFAB: record.to_dict()}
    if scheduler_state is not None:
        scheduler = megatron_dist.megatron_scheduler_state(scheduler_state)
        objects.update({SCHEDULER + k: v for k, v in scheduler.items()})
    return objects


# ---- load ----------------------------------------------------------------------------------------
def megafab_view(stored: dict, model_cfg, path: str) -> tuple[dict, dict]:
    """(megafab key -> TensorStorageMetadata of megafab's stored-view shape, megafab key ->
    {(expert, half): fsdp_dtensor key}) of a checkpoint's DCP metadata. The weights double as the
    main params (Megatron-FSDP keeps no other copy)."""
    te, swiglu = model_cfg.transformer_impl == "transformer_engine", gated_linear_unit(model_cfg)
    found, keys = {}, {}
    for key, md in stored.items():
        parsed = fk.parse(key, te) if hasattr(md, "size") else None
        if parsed is None:
            continue
        name, kind, expert, half = parsed
        if kind == STEP:  # one 0-d step, whichever piece it is read from
            expert = half = None
        fab = model_key(name) if kind is None else optim_key(name, kind)
        keys.setdefault(fab, {})[(expert, half)] = key
        if half is not None and strided_dim(name, swiglu) is None:
            raise CheckpointError(f"{path}: {key!r} is half of a SwiGLU fc1 but this model's fc1 is not "
                                  f"gated; pass the checkpoint's --swiglu")
        found[fab] = md
    view = {}
    for fab, pieces in keys.items():
        md = found[fab]
        shape = tuple(md.size)
        if any(h is not None for _, h in pieces):
            dim = strided_dim(split_key(fab)[0], swiglu) - (1 if any(e is not None for e, _ in pieces) else 0)
            shape = (*shape[:dim], 2, *shape[dim:])
        if any(e is not None for e, _ in pieces):
            shape = (1 + max(e for e, _ in pieces), *shape)
        view[fab] = type(md)(md.properties, torch.Size(shape), [])
    if not mk.model_names(view):
        raise CheckpointError(f"{path} holds DCP files without metadata.json and without `model.` "
                              f"weights: not Megatron's fsdp_dtensor (nor its torch_dcp, which megafab "
                              f"does not read), perhaps a torch_dist save that did not finish; load an "
                              f"earlier iteration, or a checkpoint saved with the model")
    for fab in [k for k in view if k.startswith(MODEL_PREFIX)]:
        view.setdefault(optim_key(fab[len(MODEL_PREFIX):], MAIN_PARAM), view[fab])
    return view, keys


class FsdpDtensorSource(CheckpointSource):
    """An fsdp_dtensor checkpoint read into megafab keys; model_cfg None: the model it records."""

    def __init__(self, path: str, model_cfg=None, release: bool = False):
        io = megatron_dist.dcp_io()
        metadata = io.read_metadata(path)
        io.check_files(path, metadata)
        stored = metadata.state_dict_metadata
        step_key = _group_step_key(stored)
        objects = _objects(io, path, stored, step_key)
        ours, args = objects.get(MEGAFAB), flat_from_args(objects.get("args"))
        model_cfg = model_cfg or megatron_dist.saved_config({MEGAFAB: ours, "args": objects.get("args")},
                                                            path).model
        self.model_cfg = model_cfg
        view, self.keys = megafab_view(stored, model_cfg, path)
        has_optimizer = any(split_key(k)[1] in MOMENTS for k in view)
        self.step = float(objects[step_key]) if step_key is not None else None
        if ours is not None:
            counters, vocab = counters_from_common(ours), ours["config"].get("vocab_size")
            rng_layout = ours["layout"] if ours["has_rng"] else None
        else:
            sched = {k[len(SCHEDULER):]: v for k, v in objects.items() if k.startswith(SCHEDULER)}
            flops = "num_floating_point_operations_so_far"
            common = {"iteration": objects["iteration"], "opt_param_scheduler": sched,
                      flops: objects.get(flops)} if "iteration" in objects and sched else {}
            counters = megatron_dist._megatron_counters(common, args)
            vocab, rng_layout = args.get("vocab_size"), None
        problem = None
        if has_optimizer and self.step is None and not any(split_key(k)[1] == STEP for k in view):
            problem = "it records no Adam step (no param_to_group_meta.*.step, no optimizer.state.*.step)"
        rng_missing = None if ours is not None else megatron_dist.MEGATRON_RNG
        super().__init__(FORMAT, path, view, args or None, vocab, None if release else counters,
                         has_optimizer, problem, rng_layout, rng_missing)

    def read(self, shards: dict[str, Shard]) -> None:
        swiglu, out = gated_linear_unit(self.model_cfg), {}
        for key, shard in shards.items():
            name, kind = split_key(key)
            if kind == STEP and (self.step is not None or key not in self.keys):
                for view in shard.views:
                    view.fill_(self.step or 0.0)
                continue
            keys = self.keys[model_key(name) if kind == MAIN_PARAM else key]
            if kind == STEP:  # torch.optim's 0-d step tensor
                out[keys[(None, None)]] = shard
                continue
            for tag, shape, box, view in fk.pieces(name, shard, swiglu):
                out.setdefault(keys[tag], Shard(shape)).add(box, view)
        megatron_dist.dcp_io().load_shards(out, self.path)


def partial_load(shards: dict[str, Shard], stored: dict, path: str, finetune: bool,
                 strictness: str) -> str | None:
    """--no-strict-fsdp-dtensor-load, Megatron's partial DCP load: what the checkpoint lacks is left
    out of the read (optimizer moments start at 0) with a warning naming it, but weights it lacks
    stop the load unless --finetune, or --dist-ckpt-strictness log_*/return_*/ignore_all (Megatron's
    validate_fsdp_dtensor_model_load, which takes assume_ok_unexpected as raise_unexpected)."""
    absent = strict_load.unexpected_keys(shards, stored)
    weights = [k for k in absent if split_key(k)[1] in (None, MAIN_PARAM)]
    if weights and not finetune and strictness in ("assume_ok_unexpected", "raise_unexpected", "raise_all"):
        raise CheckpointError(f"{strict_load.message(path, weights, [])}, which would keep their initial "
                              f"values (--no-strict-fsdp-dtensor-load loads the rest): load a checkpoint of "
                              f"this model, or pass --finetune or --dist-ckpt-strictness log_unexpected to "
                              f"start them fresh")
    warning = strict_load.apply("log_unexpected", shards, path, absent, [])
    flag = "--no-strict-fsdp-dtensor-load"
    return warning and warning.replace("--dist-ckpt-strictness log_unexpected", flag)


def _objects(io, path: str, stored: dict, step_key: str | None) -> dict:
    """The checkpoint's records and scheduler state (and `step_key`'s), in one read."""
    keys = [k for k in stored if k in ("args", "iteration", "checkpoint_version", MEGAFAB,
                                       "num_floating_point_operations_so_far")
            or k.startswith(SCHEDULER) or k == step_key]
    raw = io.read_objects(path, keys) if keys else {}
    return {k: safe_pickle.loads(v, f"{path} ({k})") for k, v in raw.items()}


def _group_step_key(stored: dict) -> str | None:
    """Where Megatron's FusedAdam keeps Adam's step: a param group's `step` (every group's alike)."""
    return next((k for k in stored if k.startswith(fk.GROUP_META) and k.endswith(".step")), None)
