"""Save and load a training state as a checkpoint that loads into any TP/PP/VPP/DP layout.

Saved as Megatron-LM's torch_dist (megatron_dist.py; megatron-core loads it), with --ckpt-format
torch as Megatron's legacy per-rank files (megatron_legacy.py), with fsdp_dtensor as Megatron-FSDP's
DCP state dict (fsdp_dtensor.py). Loaded from any, or from megafab's earlier format (formats.py tells
them apart by their files). The directory and its atomic commit:
directory.py. What each rank writes and reads: state.py (its own boxes only; no rank ever holds the
DP-unsharded optimizer state). Loading never unpickles code: DCP tensors and safe metadata (dcp_io),
JSON, safe_pickle for Megatron's pickled files, torch.load(weights_only=True) for the RNG files.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist

from megafab.checkpoint import (
    formats,
    fsdp_dtensor,
    integrity,
    megatron_dist,
    megatron_keys,
    megatron_legacy,
    non_persistent,
)
from megafab.checkpoint import state as cs
from megafab.checkpoint import strictness as strict_load
from megafab.checkpoint.directory import (  # noqa: F401
    FORMAT_VERSION,
    TRACKER,
    commit_checkpoint,
    iteration_dir,
    iteration_of_directory,
    latest_iteration,
    retain_interval,
)
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import STEP, split_key
from megafab.checkpoint.megatron_args import check_model_args
from megafab.checkpoint.moe_check import check_moe_matches
from megafab.checkpoint.source import RNG_DIR, CommonRecord, Counters, MegafabSource, rng_file, run_layout
from megafab.checkpoint.vocab import adapt_padded_vocab
from megafab.config.moe import moe_settings
from megafab.distributed.param_gather import finish_param_syncs
from megafab.errors import ReportedElsewhere
from megafab.param_names import layer_of

PENDING_RNG = "checkpoint_rng"


def dcp_io():
    """torch.distributed.checkpoint costs seconds to import; only runs that save or load pay."""
    # deferred: torch.distributed.checkpoint costs seconds to import; only saves and loads pay it
    from megafab.checkpoint import dcp_io as io

    return io


def _layout(topo, cfg) -> dict:
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    return run_layout(topo.tp, topo.pp, topo.dp, vpp, topo.cp, topo.ep, topo.etp, topo.order)


def _print0(topo, text: str) -> None:
    if topo.rank == 0:
        print(text, flush=True)


# ---- save ----------------------------------------------------------------------------------------
def common_record(state, with_optim: bool) -> CommonRecord:
    """The run's counters, layout and config as the checkpoint records them (source.CommonRecord)."""
    opt = state.optimizer
    scaler = getattr(opt, "grad_scaler", None)
    counters = Counters(state.iteration, state.consumed_train_samples, state.consumed_valid_samples,
                        state.skipped_iterations, state.nan_iterations, state.scheduler.state_dict(),
                        opt.iteration, scaler.state_dict() if scaler is not None else None,
                        state.num_floating_point_operations_so_far)
    return CommonRecord(state.iteration, _layout(state.topology, state.cfg), state.cfg.to_flat(), counters,
                        has_optimizer=with_optim, has_rng=not state.cfg.checkpoint.no_save_rng)


def _held_layers(state) -> list[int]:
    return sorted({layer_of(n) for n, _ in cs.named_parameters(state)} - {None})


def start_save(state, root: str | None = None) -> str:
    """Collective, the start of every save: the parameters synced and an empty ROOT/iter_N.tmp (ROOT:
    --save, or a non-persistent checkpoint's directory)."""
    root, topo = root or state.cfg.checkpoint.save, state.topology
    tmp = iteration_dir(root, state.iteration) + ".tmp"
    finish_param_syncs(state.model)  # --overlap-param-gather leaves them to the next forward
    if topo.rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, RNG_DIR))
    dist.barrier()
    return tmp


def save_checkpoint(state, root: str | None = None, on_retired=None) -> str:
    """Collective: save `state` as ROOT/iter_NNNNNNN (directory.py; ROOT default --save) in --ckpt-format;
    returns the path. on_retired: called on rank 0 with the iteration --save-retain-interval deleted."""
    cfg, topo = state.cfg, state.topology
    ck = cfg.checkpoint
    root, iteration = root or ck.save, state.iteration
    start = time.time()
    with_optim = not ck.no_save_optim
    tmp = start_save(state, root)
    if ck.ckpt_format == formats.TORCH:
        common = megatron_dist.megatron_common(cfg, common_record(state, False), formats.TORCH,
                                               state.scheduler.state_dict())
        megatron_legacy.save_rank_file(state, tmp, common)
    else:
        _save_torch_dist(state, tmp, with_optim)
    if not ck.no_save_rng:
        torch.save(cs.rng_snapshot(state), rng_file(tmp, topo.rank))
    dist.barrier()
    if topo.rank == 0:
        retired = commit_checkpoint(root, iteration, retain_interval(ck, root), ck.verify_integrity)
        if retired is not None and on_retired is not None:
            on_retired(retired)
    dist.barrier()
    _print0(topo, f"saved checkpoint at iteration {iteration:7d} to {root} in {ck.ckpt_format} format "
                  f"({time.time() - start:.1f} s)")
    return iteration_dir(root, iteration)


def _save_torch_dist(state, tmp: str, with_optim: bool) -> None:
    shards, objects, common = dcp_parts(state, with_optim)
    dcp_io().save_shards(shards, tmp, objects)
    if common is not None:
        megatron_dist.write_common(tmp, common)


def dcp_parts(state, with_optim: bool):
    """(Shards, byte objects, common.pt's dict or None) of a DCP save in --ckpt-format: torch_dist,
    or fsdp_dtensor (everything in the DCP files, no common.pt)."""
    if state.cfg.checkpoint.ckpt_format == formats.FSDP_DTENSOR:
        return fsdp_dtensor_parts(state, with_optim)
    return torch_dist_parts(state, with_optim)


def fsdp_dtensor_parts(state, with_optim: bool):
    """(fsdp_dtensor-keyed Shards, byte objects, None) of an fsdp_dtensor save of `state` as it is now."""
    cfg, topo = state.cfg, state.topology
    shards, objects = cs.model_shards_for_save(state), {}
    if with_optim:
        shards.update(cs.optimizer_shards_for_save(state))
        objects.update(fsdp_dtensor.group_meta_objects(state, float(cs.common_step(state.optimizer))))
    if topo.rank == 0:
        objects.update(fsdp_dtensor.common_objects(cfg, common_record(state, with_optim),
                                                   state.scheduler.state_dict()))
    return fsdp_dtensor.to_fsdp(shards, cfg), objects, None


def torch_dist_parts(state, with_optim: bool):
    """(Megatron-keyed Shards, byte objects, common.pt's dict on rank 0 else None) of a torch_dist save
    of `state` as it is now (the Shards are views of the live tensors)."""
    cfg, topo = state.cfg, state.topology
    dist_opt = cfg.parallel.use_distributed_optimizer
    shards = cs.model_shards_for_save(state)
    if with_optim:
        shards.update(cs.optimizer_shards_for_save(state))
    moe = moe_settings(cfg)
    stacked = megatron_keys.stacks_layers(moe)
    layers, objects = _held_layers(state), {}
    if topo.tp_rank == 0 and topo.dp_rank == 0:
        objects = megatron_dist.extra_state_objects(layers, cfg.model.num_layers, moe, stacked, cfg.model)
        if topo.is_last_stage:
            objects.update(megatron_dist.mtp_extra_state_objects(cfg.model, moe))
    experts = cs.expert_placement(state)
    if experts is not None and topo.coord("etp") == 0 and topo.coord("edp") == 0:  # each expert's once
        local = range(experts.first, experts.first + moe.num_experts // topo.size("ep"))
        objects.update(megatron_dist.expert_extra_state_objects(layers, cfg.model.num_layers, moe, local,
                                                                stacked))
        if topo.is_last_stage:
            objects.update(megatron_dist.mtp_expert_extra_state_objects(cfg.model, moe, local))
    common = None
    if topo.rank == 0:
        step = float(cs.common_step(state.optimizer)) if with_optim else None
        common = megatron_dist.common_state(cfg, common_record(state, with_optim),
                                            state.scheduler.state_dict(), step, dist_opt)
    return megatron_dist.megatron_shards(shards, cfg.model, dist_opt, stacked), objects, common


# ---- load ----------------------------------------------------------------------------------------
def open_source(found: formats.Found, model_cfg):
    """The CheckpointSource of a found checkpoint (source.py)."""
    if found.format == formats.MEGAFAB:
        return MegafabSource(found.path)
    if found.format == formats.TORCH_DIST:
        return megatron_dist.TorchDistSource(found.path, model_cfg, found.release)
    if found.format == formats.FSDP_DTENSOR:
        return fsdp_dtensor.FsdpDtensorSource(found.path, model_cfg, found.release)
    return megatron_legacy.LegacySource(found.path, model_cfg, found.release)


def _load_scheduler(state, saved: dict, load_dir: str) -> None:
    """Megatron's rule: a schedule setting that differs between the checkpoint and the command line
    stops the run unless one of the two flags says which wins."""
    o = state.cfg.optimizer
    if not (o.override_opt_param_scheduler or o.use_checkpoint_opt_param_scheduler):
        differ = state.scheduler.differences(saved)
        if differ:
            lines = "; ".join(f"{name} {now} now ({state.scheduler.SETTINGS[name]}), {then} in the checkpoint"
                              for name, now, then in differ)
            raise CheckpointError(
                f"--load {load_dir}: the learning-rate schedule differs from the checkpoint's: {lines}. "
                f"Pass --override-opt_param-scheduler to run this command line's schedule from the "
                f"checkpoint's position, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    state.scheduler.load_state_dict(saved, keep_settings=o.override_opt_param_scheduler)


def load_checkpoint(state) -> int | None:
    """Collective: restore `state` from --load (see the flags in CheckpointConfig); returns the
    iteration loaded, or None when the directory holds no checkpoint (training starts fresh)."""
    cfg, topo = state.cfg, state.topology
    ck = cfg.checkpoint
    load_dir, note = non_persistent.choose_load_dir(ck, ck.load)
    finetune = ck.finetune
    if note is not None:
        _print0(topo, f"megafab: note: {note}")
    found = formats.find_checkpoint(load_dir, ck.ckpt_step) if load_dir else None
    named = iteration_of_directory(load_dir) if load_dir and found is None else None
    if named is not None and os.path.isdir(load_dir):  # --load SAVE/iter_0000004: that checkpoint
        load_dir = os.path.dirname(os.path.normpath(load_dir))
        _print0(topo, f"megafab: note: --load {ck.load} names one checkpoint; loading iteration {named} "
                      f"of {load_dir}")
        found = formats.find_checkpoint(load_dir, named)
    if found is None and ck.pretrained_checkpoint:  # Megatron: fine-tune from it until --load has one
        load_dir, finetune = ck.pretrained_checkpoint, True
        found = formats.find_checkpoint(load_dir)
        if found is None:
            raise CheckpointError(f"neither --load {ck.load} nor --pretrained-checkpoint {load_dir} holds a "
                                  f"checkpoint ({TRACKER} not found); point them at a --save directory")
    if found is None:
        if ck.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {ck.load} holds no checkpoint ({TRACKER} not found) and "
                                  f"--exit-on-missing-checkpoint is set; fix the path or drop the flag")
        _print0(topo, f"megafab: no checkpoint in {ck.load} ({TRACKER} not found); training from scratch")
        return None
    formats.check_requested_format(found, ck.ckpt_format, ck.auto_detect_ckpt_format)
    if ck.verify_integrity:
        integrity.verify(found.path, topo)
    source = open_source(found, cfg.model)
    path, iteration = found.path, found.iteration
    finetune = finetune or found.release  # Megatron: a release checkpoint is always fine-tuned from
    if source.saved_args is not None:
        check_model_args(source.saved_args, cfg.model, path, cfg.moe)
    else:
        _print0(topo, f"megafab: note: {path} records no args; the model flags are checked against its "
                      f"tensor shapes only")
    if source.counters is None and not finetune:
        raise CheckpointError(f"{path} holds weights only (no iteration, scheduler or optimizer state, "
                              f"e.g. imported from HuggingFace or saved by dist_checkpointing alone); "
                              f"continue from it with --finetune")
    load_optim = not finetune and not ck.no_load_optim and source.has_optimizer
    if load_optim and source.optimizer_problem:
        raise CheckpointError(f"{path} cannot restore the optimizer: {source.optimizer_problem}; pass "
                              f"--no-load-optim to load the weights and counters with a fresh optimizer "
                              f"(or --finetune)")
    if not finetune and not ck.no_load_optim and not source.has_optimizer:
        _print0(topo, "megafab: note: the checkpoint holds no optimizer state (--no-save-optim); "
                      "the optimizer starts fresh")

    stored = source.stored
    # A checkpoint saved from an fp32 model has no main copies; bf16 mains then take the weights.
    with_main = load_optim and any(k.endswith(".main_param") for k in stored)
    shards, gather = cs.model_shards_for_load(state, masters_from_main=with_main)
    targets = []
    if load_optim:
        optim_shards, targets = cs.optimizer_shards_for_load(state, with_main=with_main)
        shards.update(optim_shards)
    notes, padding = [], []
    # --dist-ckpt-strictness (checkpoint/strictness.py): torch_dist (and megafab's) only, as Megatron's;
    # fsdp_dtensor's strict load is DCP's (a tensor it lacks stops the load), its partial load
    # (--no-strict-fsdp-dtensor-load) fsdp_dtensor.partial_load
    partial = source.format == formats.FSDP_DTENSOR and not ck.strict_fsdp_dtensor_load
    strictness = ck.dist_ckpt_strictness if source.format in ("torch_dist", "megafab") \
        else "assume_ok_unexpected"
    mismatched = strict_load.mismatches(strictness, shards, stored)

    def prepare():
        if partial:
            notes.append(fsdp_dtensor.partial_load(shards, stored, source.path, finetune,
                                                   ck.dist_ckpt_strictness))
        warning = strict_load.apply(strictness, shards, source.path, *mismatched)
        notes.extend([warning] if warning else [])
        vocab = source.saved_vocab_size or cfg.model.vocab_size  # Megatron records only the padded size
        note, fill = adapt_padded_vocab(shards, stored, vocab, cfg.model, source.path)
        notes.extend([note] if note else [])
        padding.extend([fill] if fill else [])
        check_moe_matches(stored, {k: s.global_shape for k, s in shards.items()}, source.path)
        # Megatron keeps Adam's step in common.pt, not as tensors
        dcp_io().check_shards({k: s for k, s in shards.items() if k in stored or split_key(k)[1] != STEP},
                              stored, source.path)

    _check_on_every_rank(topo, prepare)
    for note in filter(None, notes):
        _print0(topo, note if note.startswith("warning: ") else f"megafab: note: {note}")
    source.read(shards)
    for fill in padding:  # the same on every rank: the padded sizes are the checkpoint's and the model's
        fill.fill(source)
    cs.gather_params(gather)
    cs.refresh_main_params(state, skip={id(t.entry) for t in targets if t.main_loaded})
    counters = source.counters
    if counters is not None:  # Megatron's load_checkpoint keeps the count under --finetune too
        state.num_floating_point_operations_so_far = counters.num_floating_point_operations_so_far
    if load_optim:
        cs.apply_optimizer_state(state, targets)
        state.optimizer.iteration = counters.optimizer_iteration
        scaler = getattr(state.optimizer, "grad_scaler", None)
        if scaler is not None and counters.grad_scaler is not None:
            scaler.load_state_dict(counters.grad_scaler)

    if not finetune:
        state.iteration = counters.iteration
        state.consumed_train_samples = counters.consumed_train_samples
        state.consumed_valid_samples = counters.consumed_valid_samples
        state.skipped_iterations = counters.skipped_iterations
        state.nan_iterations = counters.nan_iterations
        _load_scheduler(state, {**state.scheduler.state_dict(), **counters.scheduler}, load_dir)
        _load_rng(state, source)
    dist.barrier()
    _print0(topo, f"loaded checkpoint from {load_dir} at iteration {iteration} ({source.format} format"
                  + ("; finetune: weights only, starting at iteration 0)" if finetune else ")"))
    return iteration


def _check_on_every_rank(topo, check) -> None:
    """Run `check`; if it fails on any rank, every rank stops (none is left waiting in DCP): a rank
    that found a problem raises it, the others stop silently (one of the finders speaks)."""
    error = None
    try:
        check()
    except CheckpointError as e:
        error = e
    failed = torch.tensor([0.0 if error is None else 1.0], device=topo.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        error.every_rank = False
        raise error
    if failed.item() > 0:
        raise ReportedElsewhere(None, "the checkpoint check failed on another rank")


def _load_rng(state, source) -> None:
    cfg, topo = state.cfg, state.topology
    if cfg.checkpoint.no_load_rng:
        return
    file, note = source.rng_path(topo.rank, _layout(topo, cfg))
    if note is not None:
        _print0(topo, f"megafab: note: {note}")
    if file is None:
        return
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing, so rank {topo.rank}'s random state cannot be restored; "
                              f"restore it, or pass --no-load-rng (dropout and data-loader randomness then "
                              f"differ from an uninterrupted run)", every_rank=False)
    try:
        snap = torch.load(file, weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated or foreign file
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}); restore it, or pass --no-load-rng",
                              every_rank=False) from None
    cs.restore_rng(state, snap)
    state.extra[PENDING_RNG] = snap


def restore_pending_rng(state) -> None:
    """Re-apply the loaded RNG states once more. Call it after building the data iterators:
    creating a DataLoader iterator draws a seed from torch's default generator, which the
    uninterrupted run did before its first iteration, not after the checkpointed one."""
    snap = state.extra.pop(PENDING_RNG, None)
    if snap is not None:
        cs.restore_rng(state, snap)
