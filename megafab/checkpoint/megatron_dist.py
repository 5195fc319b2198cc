"""Megatron-LM's torch_dist checkpoint: read any (megatron-core's or megafab's), write one that
megatron-core's dist_checkpointing.load reads.

    iter_0000100/
        metadata.json            {"sharded_backend": "torch_dist", ...}; written last: marks it complete
        .metadata, __R_T.distcp  DCP: tensors under Megatron keys (megatron_keys.py), and byte objects
                                 (`_extra_state`; newer megatron-core's `common_state/shard_0_1`)
        common.pt                torch.save'd dict: args, checkpoint_version 3.0, iteration, scheduler,
                                 optimizer (param groups, Adam's step, param_state_sharding_type);
                                 megafab's own counters under `megafab` (Megatron ignores the key)
        rng/rank_00000.pt        megafab-written only: each rank's RNG streams (weights-only file)

Pickled parts are read with safe_pickle (no pickled code runs); tensors by DCP as raw storage. Which
optimizer formats are read: _optimizer_problem; which are written: megatron_shards.
"""

from __future__ import annotations

import json
import os
import re

import torch

from megafab.checkpoint import megatron_keys as mk
from megafab.checkpoint import safe_pickle
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.formats import METADATA_JSON
from megafab.checkpoint.layout import MODEL_PREFIX, STEP, Shard, split_key
from megafab.checkpoint.megatron_args import flat_from_args, megatron_namespace, unknown_model
from megafab.checkpoint.megatron_dp_reshardable import SHARDING as DP_RESHARDABLE
from megafab.checkpoint.megatron_dp_reshardable import DpReshardable, args_problem
from megafab.checkpoint.source import (
    CheckpointSource,
    CommonRecord,
    Counters,
    counters_from_common,
    read_json_object,
)
from megafab.config import Config
from megafab.model.activations import gated_linear_unit
from megafab.param_names import (
    MTP_TRANSFORMER_LAYER,
    expert_extra_state_key,
    layer_extra_state_key,
    mtp_expert_extra_state_key,
    mtp_extra_state_key,
    stacked_extra_state_key,
)

COMMON_PT = "common.pt"
COMMON_STATE = "common_state/shard_0_1"
MEGAFAB = "megafab"
CHECKPOINT_VERSION = 3.0
METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
READABLE_OPTIMIZER_FORMATS = ("fully_reshardable", "fully_sharded_model_space")
BUCKETS = re.compile(rf"^(chained_\d+\.)?{re.escape(mk.OPTIM_BUCKETS)}")  # a ChainedOptimizer's member's too
# Megatron's scheduler state (counted in samples, as megafab's) -> megafab's field names.
MEGATRON_RNG = ("a Megatron-LM checkpoint's RNG states are CUDA generator states megafab does not restore; "
                "dropout masks will differ from the original run")
SCHEDULER_FIELDS = {"max_lr": "max_lr", "min_lr": "min_lr", "lr_warmup_steps": "lr_warmup_samples",
                    "lr_decay_steps": "lr_decay_samples", "lr_decay_style": "lr_decay_style",
                    "start_wd": "start_wd", "end_wd": "end_wd", "wd_incr_steps": "wd_incr_samples",
                    "wd_incr_style": "wd_incr_style", "num_steps": "num_samples"}


def dcp_io():
    # deferred: torch.distributed.checkpoint costs seconds to import; only saves and loads pay it
    from megafab.checkpoint import dcp_io as io

    return io


# ---- reading -------------------------------------------------------------------------------------
def read_metadata_json(path: str) -> dict:
    file = os.path.join(path, METADATA_JSON)
    meta = read_json_object(file)
    if meta.get("sharded_backend") != "torch_dist":
        raise CheckpointError(f"{file} names sharded_backend {meta.get('sharded_backend')!r}; megafab "
                              f"reads Megatron's torch_dist backend only (convert zarr checkpoints with "
                              f"Megatron first)")
    return meta


def read_common(path: str) -> dict:
    """The common state of a torch_dist checkpoint: common.pt, or the `common_state` object."""
    file = os.path.join(path, COMMON_PT)
    if os.path.isfile(file):
        common = safe_pickle.load(file)
    else:
        if COMMON_STATE not in dcp_io().read_metadata(path).state_dict_metadata:
            raise CheckpointError(f"{file}: missing, and the DCP files hold no {COMMON_STATE} object "
                                  f"either, so the run's args and counters are lost; the save did not finish "
                                  f"or the copy is partial: copy the whole directory, or load an earlier "
                                  f"iteration")
        raw = dcp_io().read_objects(path, [COMMON_STATE])
        common = safe_pickle.loads(raw[COMMON_STATE], f"{path} ({COMMON_STATE})")[0]
    if not isinstance(common, dict):
        raise CheckpointError(f"{file} holds a {type(common).__name__}, not Megatron's common state dict; "
                              f"restore it from the original run")
    return common


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def adam_step(common: dict) -> float | None:
    """Adam's step (the same for every parameter) where megatron-core's optimizers keep it."""
    opt = common.get("optimizer")
    for value in (_get(opt, "optimizer", "state", "common_step"), _get(opt, "state", "common_step")):
        if value is not None:
            return float(value)
    groups = _get(opt, "optimizer", "param_groups") or _get(opt, "param_groups") or []
    steps = [g["step"] for g in groups if isinstance(g, dict) and "step" in g]
    return float(steps[0]) if steps else None


def sharding_type(common: dict) -> str | None:
    """The distributed optimizer's param_state_sharding_type; a ChainedOptimizer's (dense and expert
    optimizers: common.pt's `optimizer` is {0: {...}, 1: {...}}) when its members agree."""
    opt = common.get("optimizer")
    if isinstance(opt, dict) and opt and all(isinstance(k, int) for k in opt):
        types = {_get(v, "param_state_sharding_type") for v in opt.values()}
        return types.pop() if len(types) == 1 else None
    return _get(opt, "param_state_sharding_type")


def _optimizer_problem(common: dict, view: dict, in_buckets: bool, args: dict) -> str | None:
    """Why the optimizer state cannot be restored (None: it can); in_buckets: stored as the
    distributed optimizer's flat bucket buffers (mk.OPTIM_BUCKETS keys, which `view` leaves out).

    megatron-core's plain optimizer stores `optimizer.state.{exp_avg, exp_avg_sq, fp32_param}.<key>`
    shaped like the parameter: read. Its distributed optimizer's, by param_state_sharding_type:
    fully_reshardable (`optimizer.state.{param, exp_avg, exp_avg_sq}`, parameter-shaped): read;
    fully_sharded_model_space: parameter-shaped in megatron-core >= 0.14, read; flat ranges before,
    refused; dp_reshardable (flat buffers of the saving job's DDP buckets, Megatron-LM's default):
    read by megatron_dp_reshardable where it lays the saving run out; dp_zero_gather_scatter /
    fully_sharded_bucket_space: refused by name, and --no-load-optim loads the rest."""
    sharding = sharding_type(common)
    if sharding == DP_RESHARDABLE:
        return args_problem(args) if in_buckets else (
            f"its optimizer records sharding type {sharding!r} but holds no bucket buffers "
            f"({mk.OPTIM_BUCKETS}*); the copy is partial: copy the whole directory")
    if in_buckets or (sharding is not None and sharding not in READABLE_OPTIMIZER_FORMATS):
        return (f"its distributed-optimizer state has sharding type {sharding!r}: flat buffers laid out by "
                f"the saving job's DP buckets, which megafab cannot reshard (Megatron reads them only at the "
                f"same TP/PP; save with --dist-ckpt-optim-fully-reshardable for a state megafab reads)")
    for key, md in view.items():
        name, kind = split_key(key)
        model = view.get(MODEL_PREFIX + name)
        if kind is not None and model is not None and tuple(md.size) != tuple(model.size):
            return (f"its optimizer tensor {key!r} is stored flattened ({tuple(md.size)}, the pre-0.14 "
                    f"{sharding or 'optimizer'} layout) rather than shaped like the parameter "
                    f"{tuple(model.size)}")
    return None


def _megatron_counters(common: dict, args: dict) -> Counters | None:
    sched = common.get("opt_param_scheduler")
    if sched is None or "iteration" not in common:
        return None
    scheduler = {SCHEDULER_FIELDS[k]: v for k, v in sched.items() if k in SCHEDULER_FIELDS}
    return Counters(int(common["iteration"]), int(args.get("consumed_train_samples", 0)),
                    int(args.get("consumed_valid_samples", 0)), scheduler=scheduler,
                    optimizer_iteration=int(common["iteration"]),
                    grad_scaler=_scaler_state(_get(common, "optimizer", "grad_scaler")),
                    num_floating_point_operations_so_far=float(
                        common.get("num_floating_point_operations_so_far") or 0))


def _scaler_state(scaler: dict | None) -> dict | None:
    """Megatron's loss-scaler state with plain numbers."""
    return None if scaler is None else {k: float(v) if torch.is_tensor(v) else v for k, v in scaler.items()}


def saved_config(common: dict, path: str):
    """The Config a torch_dist checkpoint was saved with: megafab's own, or built from Megatron's args
    (whose names are megafab's config fields; Megatron's validate_args derived the sizes)."""
    ours = common.get(MEGAFAB)
    flat = ours["config"] if ours is not None else flat_from_args(common.get("args"))
    if not flat.get("num_layers"):
        raise unknown_model(path)
    return Config.from_flat(flat)


class TorchDistSource(CheckpointSource):
    """A torch_dist checkpoint read into megafab keys (megatron_keys.to_megatron at read time);
    model_cfg None: the model the checkpoint records (saved_config)."""

    def __init__(self, path: str, model_cfg=None, release: bool = False):
        read_metadata_json(path)
        common = read_common(path)
        self.common = common
        model_cfg = model_cfg or saved_config(common, path).model
        metadata = dcp_io().read_metadata(path)
        dcp_io().check_files(path, metadata)
        self.model_cfg, self.stacked = model_cfg, mk.is_stacked(metadata.state_dict_metadata)
        self.parameter_keys = mk.parameter_keys(metadata.state_dict_metadata)
        view = mk.megafab_view(metadata.state_dict_metadata, model_cfg, path)
        if not mk.model_names(view):
            raise CheckpointError(f"{path} is a torch_dist checkpoint without model weights (its DCP "
                                  f"metadata holds no model tensor); load a checkpoint saved with the model")
        ours = common.get(MEGAFAB)
        args = flat_from_args(common.get("args"))
        if ours is not None:
            counters, vocab = counters_from_common(ours), ours["config"].get("vocab_size")
            rng_layout = ours["layout"] if ours["has_rng"] else None
        else:
            counters, vocab, rng_layout = _megatron_counters(common, args), args.get("vocab_size"), None
        # Megatron-LM's default distributed-optimizer save (dp_reshardable) keeps its state in bucket
        # buffers only (megatron_dp_reshardable lays them out; other bucket formats are refused by name)
        in_buckets = any(BUCKETS.match(k) for k in metadata.state_dict_metadata)
        has_optimizer = in_buckets or any(split_key(k)[1] is not None for k in view)
        self.step = adam_step(common)
        problem = _optimizer_problem(common, view, in_buckets, args) if has_optimizer else None
        self.buckets = None
        if in_buckets and problem is None:
            try:
                self.buckets = DpReshardable(path, metadata.state_dict_metadata, view, args, model_cfg,
                                             gated_linear_unit(model_cfg))
            except CheckpointError as e:  # --no-load-optim still loads the rest
                problem = str(e)
            else:
                view.update(self.buckets.optimizer_view(view))
                self.step = self.buckets.step
                if counters is not None and counters.grad_scaler is None:  # fp16: beside the buckets
                    counters.grad_scaler = _scaler_state(self.buckets.grad_scaler)
        if problem is None and self.step is None and any(k.endswith(".exp_avg") for k in view):
            problem = "it records no Adam step for its Adam moments (common.pt holds no param_groups step)"
        stored_keys = metadata.state_dict_metadata
        self.main_kind = next((kind for kind in mk.MAIN_PARAM_KINDS if any(
            k.startswith(mk.megatron_optim_key(kind, "")) for k in stored_keys)), "fp32_param")
        super().__init__("torch_dist", path, view, args or None, vocab, None if release else counters,
                         has_optimizer, problem, rng_layout, None if ours is not None else MEGATRON_RNG)

    def read(self, shards: dict[str, Shard]) -> None:
        for key, shard in shards.items():
            if split_key(key)[1] == STEP:
                for view in shard.views:
                    view.fill_(self.step or 0.0)  # SGD keeps no step
        buckets, copies = {}, []
        if self.buckets is not None:  # the optimizer state from dp_reshardable bucket buffers
            optim = {k: s for k, s in shards.items() if split_key(k)[1] not in (None, STEP)}
            shards = {k: s for k, s in shards.items() if k not in optim}
            buckets, copies = self.buckets.plan(optim)
        megatron = mk.to_megatron(shards, self.model_cfg, self.main_kind, self.stacked, self.parameter_keys)
        dcp_io().load_shards({**megatron, **buckets}, self.path)
        for target, read in copies:
            target.copy_(read)

    def read_all(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every stored tensor whose megafab key starts with `prefix`, whole (for one process:
        conversion, inspection)."""
        shards = {k: Shard.whole(torch.empty(tuple(md.size), dtype=md.properties.dtype))
                  for k, md in self.stored.items() if k.startswith(prefix)}
        self.read(shards)
        return {k: s.views[0] for k, s in shards.items()}


# ---- writing -------------------------------------------------------------------------------------
def _layer_modules(layer: int, moe, model_cfg=None) -> tuple[str, ...]:
    attention = mk.attention_modules(model_cfg)  # linear_qkv / linear_proj, or MLA's projections
    if moe is None or not moe.is_moe_layer(layer):
        return attention + mk.EXTRA_STATE_MODULES[len(mk.ATTENTION_MODULES):]
    shared = mk.SHARED_EXPERT_MODULES if moe.moe_shared_expert_intermediate_size is not None else ()
    return attention + shared


def extra_state_objects(layers, num_layers: int, moe=None, stacked: bool = True,
                        model_cfg=None) -> dict[str, list]:
    """The `_extra_state` byte objects of `layers` (global numbers) megatron-core's loader asks for,
    but the routed experts' (expert_extra_state_objects): [None] each, as its local-spec linear
    layers save (Transformer Engine layers accept None too). moe: the MoE settings (cfg.moe);
    model_cfg: the model's (multi-latent attention has its own projections; None: standard)."""
    def key(module, layer):
        return stacked_extra_state_key(module, layer, num_layers) if stacked else \
            layer_extra_state_key(module, layer)
    return {key(module, layer): [None]
            for layer in layers for module in _layer_modules(layer, moe, model_cfg)}


def mtp_extra_state_objects(model_cfg, moe=None) -> dict[str, list]:
    """The `_extra_state` objects of the multi-token prediction layers (the last stage's): each
    depth's eh_proj and its transformer layer's linear modules (the decoder's last layer's kind;
    the local spec's, MTP runs no Transformer Engine layer)."""
    modules = ("eh_proj",) + tuple(MTP_TRANSFORMER_LAYER + m
                                   for m in _layer_modules(model_cfg.num_layers - 1, moe, model_cfg)
                                   if m != "self_attention.core_attention")
    return {mtp_extra_state_key(module, depth): [None]
            for depth in range(model_cfg.mtp_num_layers or 0) for module in modules}


def mtp_expert_extra_state_objects(model_cfg, moe, experts) -> dict[str, list]:
    """The MTP layers' routed experts' `_extra_state` objects (an MoE last layer's kind): one per
    (depth, global expert in `experts`, linear module)."""
    if moe is None or moe.num_experts is None or not moe.is_moe_layer(model_cfg.num_layers - 1):
        return {}
    return {mtp_expert_extra_state_key(module, depth, e, moe.num_experts): [None]
            for depth in range(model_cfg.mtp_num_layers or 0) for e in experts
            for module in mk.EXPERT_MODULES}


def expert_extra_state_objects(layers, num_layers: int, moe, experts,
                               stacked: bool = True) -> dict[str, list]:
    """The routed experts' `_extra_state` objects: one per (MoE layer of `layers`, global expert in
    `experts`, linear module)."""
    if moe is None or moe.num_experts is None:
        return {}
    return {expert_extra_state_key(module, layer, num_layers if stacked else None, e, moe.num_experts): [None]
            for layer in layers if moe.is_moe_layer(layer) for e in experts for module in mk.EXPERT_MODULES}


def megatron_scheduler_state(scheduler_state: dict) -> dict:
    return {k: scheduler_state[v] for k, v in SCHEDULER_FIELDS.items()}


def megatron_common(cfg, record: CommonRecord, ckpt_format: str, scheduler_state: dict | None) -> dict:
    """What every Megatron file megafab writes records (torch_dist's common.pt, each legacy rank
    file): the args, Megatron's counters and version, megafab's CommonRecord, the LR schedule."""
    common = {"args": megatron_namespace(cfg, record, ckpt_format), "checkpoint_version": CHECKPOINT_VERSION,
              "iteration": record.iteration,
              "num_floating_point_operations_so_far": record.num_floating_point_operations_so_far,
              MEGAFAB: record.to_dict()}
    if scheduler_state is not None:
        common["opt_param_scheduler"] = megatron_scheduler_state(scheduler_state)
    return common


def common_state(cfg, record: CommonRecord, scheduler_state: dict | None, step: float | None,
                 distributed_optimizer: bool) -> dict:
    """common.pt of a megafab-written torch_dist checkpoint (plain data and the args Namespace)."""
    common = {**megatron_common(cfg, record, "torch_dist", scheduler_state),
              "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}}
    if step is not None:
        optimizer = {"optimizer": {"state": {"common_step": step}, "param_groups": [{"step": step}]}}
        if distributed_optimizer:
            optimizer["param_state_sharding_type"] = "fully_reshardable"
            common["content_metadata"]["distrib_optim_sharding_type"] = "fully_reshardable"
        common["optimizer"] = optimizer
    return common


def write_common(path: str, common: dict) -> None:
    """Rank 0, after every rank's DCP files: common.pt, then metadata.json (the completion mark)."""
    torch.save(common, os.path.join(path, COMMON_PT))
    with open(os.path.join(path, METADATA_JSON), "w") as f:
        json.dump(METADATA, f)
        f.flush()
        os.fsync(f.fileno())


def megatron_shards(shards: dict[str, Shard], model_cfg, distributed_optimizer: bool,
                    stacked: bool = True) -> dict[str, Shard]:
    """A save's megafab-keyed Shards as torch_dist's; stacked: mk.stacks_layers. The optimizer state
    is written in megatron-core's plain optimizer's form (`fp32_param`), or in fully_reshardable
    form (`param`) from the distributed optimizer: each DP rank its own boxes of the
    parameter-shaped tensors, never a gathered copy."""
    if not distributed_optimizer:
        return mk.to_megatron(shards, model_cfg, "fp32_param", stacked)
    out = mk.to_megatron(shards, model_cfg, "param", stacked)
    has_optim = any(k.startswith(mk.OPTIM_STATE) for k in out)
    if has_optim:  # fp32 models keep no main copy; megatron-core's fully_reshardable has `param` always
        for key in [k for k in out if not k.startswith(mk.OPTIM_STATE)]:
            out.setdefault(mk.megatron_optim_key("param", key), out[key])
    return out
