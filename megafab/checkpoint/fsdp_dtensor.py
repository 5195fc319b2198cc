"""Megatron-LM's fsdp_dtensor checkpoint (--ckpt-format fsdp_dtensor, Megatron-FSDP's): read, written.

One torch DCP directory (.metadata + __R_0.distcp; no metadata.json, no common.pt): Megatron's whole
state dict, flattened by DCP (nested dict keys joined by '.'), each tensor under its global shape:
  model.{P}<name>                    weights, per layer (decoder.layers.N.*, N global, never stacked);
                                     names of the live modules (TE: linear_qkv.layer_norm_weight)
  model.{P}<...>.linear_fc1.weight_w / _v   SwiGLU's fc1 [2f, h] as gate [f, h] and up [f, h] (bias too)
  model.{P}<module>._extra_state     byte objects (None without FP8)
  optimizer.state.{P}module.<name>.exp_avg / .exp_avg_sq   Adam's moments, shaped like the weight (_w/_v)
  optimizer.state.{P}module.<name>.step                    0-d (torch.optim's Adam; FusedAdam has none)
  optimizer.param_to_group_meta.{P}module.<name>.<k>       the param group's lr, weight_decay, step, ...
  args (Namespace), checkpoint_version (3.0), iteration, num_floating_point_operations_so_far,
  opt_param_scheduler.<k> (max_lr, num_steps, ...), rng_state.(<pp>, <tp>).<dp>.* (CUDA states),
  rerun_state_machine.*                                    byte objects
{P} is the wrapper path Megatron's module names carry: 'module.' (Megatron-FSDP), 'module.module.'
with Float16Module (--bf16/--fp16). The weights are Megatron-FSDP's main (fp32) params when it keeps
them. megafab writes the same, megafab's own record under `megafab` and its RNG files in rng/, and
reads any depth of {P}. Routed experts (renamed to global indices) and MTP layers are not mapped yet.
"""

from __future__ import annotations

import re

import torch

from megafab.checkpoint import megatron_dist, safe_pickle
from megafab.checkpoint import megatron_keys as mk
from megafab.checkpoint.boxes import Box
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import (
    MAIN_PARAM,
    MODEL_PREFIX,
    STEP,
    Shard,
    is_tied_copy,
    model_key,
    optim_key,
    split_key,
    strided_dim,
)
from megafab.checkpoint.megatron_args import flat_from_args, megatron_namespace
from megafab.checkpoint.source import CheckpointSource, counters_from_common
from megafab.checkpoint.state import named_parameters
from megafab.model.activations import gated_linear_unit
from megafab.param_names import OUTPUT_LAYER, local_to_te_name, te_to_local_name

FORMAT = "fsdp_dtensor"
MODEL = "model."
WRAPPER = "module."
OPTIM_STATE = "optimizer.state."
GROUP_META = "optimizer.param_to_group_meta."
SCHEDULER = "opt_param_scheduler."
HALVES = ("_w", "_v")  # SwiGLU's gate and up halves of fc1
MEGAFAB = "megafab"
CHECKPOINT_VERSION = 3.0
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
_WRAPPERS = re.compile(rf"^(?:{re.escape(WRAPPER)})+")
UNMAPPED = (("mlp.experts.", "routed experts (Megatron-FSDP renames them to global expert indices)"),
            ("mtp.layers.", "multi-token prediction layers"))


def wrappers(cfg) -> str:
    """{P}: Megatron-FSDP's 'module.', under Float16Module ('module.module.') for a 16-bit model."""
    return WRAPPER * (2 if cfg.precision.bf16 or cfg.precision.fp16 else 1)


def module_name(name: str, transformer_engine: bool) -> str:
    """The live-module name Megatron's model has for megafab parameter `name`."""
    return local_to_te_name(name) if transformer_engine else (te_to_local_name(name) or name)


def unmapped(name: str) -> str | None:
    return next((what for marker, what in UNMAPPED if marker in name), None)


# ---- save ----------------------------------------------------------------------------------------
def to_fsdp(shards: dict[str, Shard], cfg) -> dict[str, Shard]:
    """megafab-keyed Shards (model.* / optim.*) as fsdp_dtensor's, the same views. A parameter with an
    fp32 main copy is written from it (Megatron-FSDP's checkpoint weights are its main params)."""
    m = cfg.model
    swiglu, te, wrap = gated_linear_unit(m), m.transformer_impl == "transformer_engine", wrappers(cfg)
    mains = {split_key(k)[0] for k in shards if split_key(k)[1] == MAIN_PARAM}
    out: dict[str, Shard] = {}
    for key, shard in shards.items():
        name, kind = split_key(key)
        if kind is None and name in mains:
            continue
        if unmapped(name):
            raise CheckpointError(f"--ckpt-format fsdp_dtensor: megafab does not write {unmapped(name)} in "
                                  f"Megatron-FSDP's names yet; save --ckpt-format torch_dist")
        base = module_name(name, te)
        dim = strided_dim(name, swiglu)
        if kind == STEP:  # Adam's 0-d step, torch.optim's form (each SwiGLU half has its own)
            for h in HALVES if dim is not None else ("",):
                out[f"{OPTIM_STATE}{wrap}{WRAPPER}{base}{h}.{STEP}"] = shard
            continue
        if kind in (None, MAIN_PARAM):
            prefix, suffix = MODEL + wrap, ""
        else:
            prefix, suffix = OPTIM_STATE + wrap + WRAPPER, "." + kind
        if dim is None:
            out[prefix + base + suffix] = shard
            continue
        half = (*shard.global_shape[:dim], *shard.global_shape[dim + 1:])
        for s, box, view in halves(shard, dim):
            out.setdefault(prefix + base + HALVES[s] + suffix, Shard(half, write=shard.write)).add(box, view)
    return out


def halves(shard: Shard, dim: int):
    """(half s, box, view) pieces of a SwiGLU fc1 Shard in megafab's [.., 2, f, ..] stored view, as
    boxes of Megatron-FSDP's [.., f, ..] `_w` (s = 0, gate) and `_v` (s = 1, up) tensors."""
    for box, view in zip(shard.boxes, shard.views):
        o, n = box.offsets, box.sizes
        for s in range(o[dim], o[dim] + n[dim]):
            yield s, Box((*o[:dim], *o[dim + 1:]), (*n[:dim], *n[dim + 1:])), view.select(dim, s - o[dim])


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def group_meta_objects(state, step: float) -> dict:
    """param_to_group_meta: each parameter's optimizer group (its plain settings and Adam's step),
    written by the rank whose optimizer entry starts the parameter, on TP rank 0."""
    cfg, opt = state.cfg, state.optimizer
    te, wrap = cfg.model.transformer_impl == "transformer_engine", wrappers(cfg)
    swiglu = gated_linear_unit(cfg.model)
    entries, out = {e.model_param: e for e in opt.entries}, {}
    if state.topology.tp_rank != 0:
        return out
    for name, p in named_parameters(state):
        e = entries.get(p)
        if e is None or is_tied_copy(name, p) or (e.param_range or (0, 0))[0] != 0:
            continue
        groups = opt.torch_optimizer_of(e).param_groups
        group = next(g for g in groups if any(q is e.main for q in g["params"]))
        meta = {k: v for k, v in group.items() if k != "params" and _plain(v)}
        meta["step"] = int(step)
        base = module_name(name, te)
        for n in [base + h for h in HALVES] if strided_dim(name, swiglu) is not None else [base]:
            out.update({f"{GROUP_META}{wrap}{WRAPPER}{n}.{k}": v for k, v in meta.items()})
    return out


def common_objects(cfg, record, scheduler_state: dict | None) -> dict:
    """Rank 0's byte objects: args, counters, schedule, megafab's record."""
    objects = {"args": megatron_namespace(cfg, record, FORMAT), "checkpoint_version": CHECKPOINT_VERSION,
               "iteration": record.iteration, "num_floating_point_operations_so_far": 0,
               MEGAFAB: record.to_dict()}
    if scheduler_state is not None:
        scheduler = megatron_dist.megatron_scheduler_state(scheduler_state)
        objects.update({SCHEDULER + k: v for k, v in scheduler.items()})
    return objects


def extra_state_objects(cfg, layers) -> dict:
    """`_extra_state` objects (None) of the linear modules Megatron's model has, in its names."""
    wrap = wrappers(cfg)
    keys = list(megatron_dist.extra_state_objects(layers, cfg.model.num_layers, None, False, cfg.model))
    keys.append(OUTPUT_LAYER.replace("weight", "_extra_state"))
    return {MODEL + wrap + k.split("/")[0]: None for k in keys}  # torch_dist's "/shard_0_1" dropped


# ---- load ----------------------------------------------------------------------------------------
def fsdp_key_to_megafab(key: str, te: bool) -> tuple[str, str | None, int | None] | None:
    """(megafab name, optimizer kind or None, SwiGLU half or None) of a stored tensor key; None for
    keys that hold no parameter state."""
    if key.startswith(MODEL):
        rest, kind = key[len(MODEL):], None
    elif key.startswith(OPTIM_STATE):
        rest, _, kind = key[len(OPTIM_STATE):].rpartition(".")
    else:
        return None
    rest = _WRAPPERS.sub("", rest)
    if rest.endswith("._extra_state"):
        return None
    half = None
    for i, h in enumerate(HALVES):
        if rest.endswith(h) and ".linear_fc1." in rest:
            rest, half = rest[:-len(h)], i
    return mk.megafab_name(rest, None, te), kind, half


def megafab_view(stored: dict, model_cfg, path: str) -> tuple[dict, dict]:
    """(megafab key -> TensorStorageMetadata of megafab's stored-view shape, megafab key -> {SwiGLU half
    or None: fsdp_dtensor key}) of a checkpoint's DCP metadata. The weights double as the main
    params (Megatron-FSDP keeps no other copy)."""
    te, swiglu = model_cfg.transformer_impl == "transformer_engine", gated_linear_unit(model_cfg)
    view, keys = {}, {}
    for key, md in stored.items():
        parsed = fsdp_key_to_megafab(key, te) if hasattr(md, "size") else None
        if parsed is None:
            continue
        name, kind, half = parsed
        half = None if kind == STEP else half  # one step for both SwiGLU halves
        if unmapped(name):
            raise CheckpointError(f"{path} holds {unmapped(name)} ({key!r}), which megafab does not read "
                                  f"from Megatron's fsdp_dtensor format yet; convert it with Megatron to "
                                  f"torch_dist")
        fab = model_key(name) if kind is None else optim_key(name, kind)
        keys.setdefault(fab, {})[half] = key
        size = tuple(md.size)
        if half is not None:
            dim = strided_dim(name, swiglu)
            if dim is None:
                raise CheckpointError(f"{path}: {key!r} is half of a SwiGLU fc1 but this model's fc1 is "
                                      f"not gated; pass the checkpoint's --swiglu")
            size = (*size[:dim], 2, *size[dim:])
        view[fab] = type(md)(md.properties, torch.Size(size), [])
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
        objects = self._objects(io, path, stored)
        ours, args = objects.get(MEGAFAB), flat_from_args(objects.get("args"))
        model_cfg = model_cfg or megatron_dist.saved_config({MEGAFAB: ours, "args": objects.get("args")},
                                                            path).model
        self.model_cfg = model_cfg
        view, self.keys = megafab_view(stored, model_cfg, path)
        has_optimizer = any(split_key(k)[1] in MOMENTS for k in view)
        self.step = self._group_step(io, path, stored)
        if ours is not None:
            counters, vocab = counters_from_common(ours), ours["config"].get("vocab_size")
            rng_layout = ours["layout"] if ours["has_rng"] else None
        else:
            sched = {k[len(SCHEDULER):]: v for k, v in objects.items() if k.startswith(SCHEDULER)}
            common = {"iteration": objects["iteration"], "opt_param_scheduler": sched} \
                if "iteration" in objects and sched else {}
            counters = megatron_dist._megatron_counters(common, args)
            vocab, rng_layout = args.get("vocab_size"), None
        problem = None
        if has_optimizer and self.step is None and not any(split_key(k)[1] == STEP for k in view):
            problem = "it records no Adam step (no param_to_group_meta.*.step, no optimizer.state.*.step)"
        rng_missing = None if ours is not None else megatron_dist.MEGATRON_RNG
        super().__init__(FORMAT, path, view, args or None, vocab, None if release else counters,
                         has_optimizer, problem, rng_layout, rng_missing)

    @staticmethod
    def _objects(io, path: str, stored: dict) -> dict:
        keys = [k for k in stored if k in ("args", "iteration", "checkpoint_version", MEGAFAB)
                or k.startswith(SCHEDULER)]
        raw = io.read_objects(path, keys) if keys else {}
        return {k: safe_pickle.loads(v, f"{path} ({k})") for k, v in raw.items()}

    @staticmethod
    def _group_step(io, path: str, stored: dict) -> float | None:
        key = next((k for k in stored if k.startswith(GROUP_META) and k.endswith(".step")), None)
        if key is None:
            return None
        value = safe_pickle.loads(io.read_objects(path, [key])[key], f"{path} ({key})")
        return float(value)

    def read(self, shards: dict[str, Shard]) -> None:
        swiglu, out = gated_linear_unit(self.model_cfg), {}
        for key, shard in shards.items():
            name, kind = split_key(key)
            if kind == STEP and (self.step is not None or key not in self.keys):
                for view in shard.views:
                    view.fill_(self.step or 0.0)
                continue
            keys = self.keys[model_key(name) if kind == MAIN_PARAM else key]
            if None in keys:
                target = out.setdefault(keys[None], Shard(tuple(self.stored[key].size)))
                for box, view in zip(shard.boxes, shard.views):
                    target.add(box, view)
                continue
            dim = strided_dim(name, swiglu)
            half = (*shard.global_shape[:dim], *shard.global_shape[dim + 1:])
            for s, box, view in halves(shard, dim):
                out.setdefault(keys[s], Shard(half)).add(box, view)
        megatron_dist.dcp_io().load_shards(out, self.path)

