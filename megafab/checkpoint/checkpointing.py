"""Save and load a training state as a checkpoint that loads into any TP/PP/VPP/DP layout.

The directory and its atomic commit: directory.py. What each rank writes and reads: state.py (its
own boxes only; no rank ever holds the DP-unsharded optimizer state). Loading never unpickles
code: DCP tensors and safe metadata (dcp_io), JSON, and torch.load(weights_only=True) for the RNG
files.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
import torch.distributed as dist

from megafab.checkpoint import state as cs
from megafab.checkpoint.directory import (
    COMMON,
    FORMAT_VERSION,
    TRACKER,
    commit_checkpoint,
    existing_iteration_dir,
    iteration_dir,
    latest_iteration,
    write_json,
)
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.vocab import adapt_padded_vocab
from megafab.distributed.fsdp import compute_dtype

# Test hook: "ITER:SECONDS" makes rank 0 sleep before committing the save of iteration ITER, so a
# test can kill the job while only the temporary directory exists.
PAUSE_ENV = "MEGAFAB_TEST_PAUSE_BEFORE_COMMIT"
PENDING_RNG = "checkpoint_rng"


def dcp_io():
    """torch.distributed.checkpoint costs seconds to import; only runs that save or load pay."""
    from megafab.checkpoint import dcp_io as io

    return io


def _layout(topo, cfg) -> dict:
    layout = {"world_size": topo.world_size, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp,
              "vpp": cfg.parallel.virtual_pipeline_model_parallel_size or 1}
    if topo.cp > 1:  # CP changes only activations; named so RNG states are not mixed up
        layout["cp"] = topo.cp
    return layout


def _print0(topo, text: str) -> None:
    if topo.rank == 0:
        print(text, flush=True)


# ---- save ----------------------------------------------------------------------------------------
def _common_state(state, with_optim: bool) -> dict:
    opt = state.optimizer
    scaler = getattr(opt, "grad_scaler", None)
    return {"format_version": FORMAT_VERSION, "iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "skipped_iterations": state.skipped_iterations, "nan_iterations": state.nan_iterations,
            "scheduler": state.scheduler.state_dict(), "optimizer_iteration": opt.iteration,
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "has_optimizer": with_optim, "has_rng": not state.cfg.checkpoint.no_save_rng,
            "layout": _layout(state.topology, state.cfg), "config": state.cfg.to_flat()}


def _test_pause(iteration: int) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if spec and int(spec.split(":")[0]) == iteration:
        print(f"checkpoint: test pause before committing iteration {iteration}", flush=True)
        time.sleep(float(spec.split(":")[1]))


def save_checkpoint(state) -> str:
    """Collective: save `state` as SAVE/iter_NNNNNNN (directory.py); returns the path."""
    cfg, topo = state.cfg, state.topology
    root, iteration = cfg.checkpoint.save, state.iteration
    tmp = iteration_dir(root, iteration) + ".tmp"
    start = time.time()
    with_optim = not cfg.checkpoint.no_save_optim
    shards = cs.model_shards_for_save(state)
    if with_optim:
        shards.update(cs.optimizer_shards_for_save(state))
    if topo.rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    dcp_io().save_shards(shards, tmp)
    if not cfg.checkpoint.no_save_rng:
        torch.save(cs.rng_snapshot(state), os.path.join(tmp, "rng", f"rank_{topo.rank:05d}.pt"))
    if topo.rank == 0:
        write_json(os.path.join(tmp, COMMON), _common_state(state, with_optim))
        _test_pause(iteration)
    dist.barrier()
    if topo.rank == 0:
        commit_checkpoint(root, iteration)
    dist.barrier()
    _print0(topo, f"saved checkpoint at iteration {iteration:7d} to {root} "
                  f"({time.time() - start:.1f} s)")
    return iteration_dir(root, iteration)


# ---- load ----------------------------------------------------------------------------------------
def load_checkpoint(state) -> int | None:
    """Collective: restore `state` from --load (see the flags in CheckpointConfig); returns the
    iteration loaded, or None when the directory holds no checkpoint (training starts fresh)."""
    cfg, topo = state.cfg, state.topology
    ck = cfg.checkpoint
    iteration = latest_iteration(ck.load)
    if iteration is None:
        _print0(topo, f"megafab: no checkpoint in {ck.load} ({TRACKER} not found); training from scratch")
        return None
    path = existing_iteration_dir(ck.load, iteration)
    if not os.path.isfile(os.path.join(path, COMMON)):
        raise CheckpointError(f"{path} has no {COMMON}: it is not a megafab checkpoint (a Megatron-LM "
                              f"torch or torch_dist checkpoint must be converted first)")
    with open(os.path.join(path, COMMON)) as f:
        common = json.load(f)
    if common.get("scheduler") is None and not ck.finetune:
        raise CheckpointError(f"{path} holds weights only (no iteration, scheduler or optimizer state, "
                              f"e.g. imported from HuggingFace); continue from it with --finetune")
    load_optim = not ck.finetune and not ck.no_load_optim and common["has_optimizer"]
    if not ck.finetune and not ck.no_load_optim and not common["has_optimizer"]:
        _print0(topo, "megafab: note: the checkpoint holds no optimizer state (--no-save-optim); "
                      "the optimizer starts fresh")

    stored = dcp_io().read_metadata(path).state_dict_metadata
    # A checkpoint saved from an fp32 model has no main copies; bf16 mains then take the weights.
    with_main = load_optim and any(k.endswith(".main_param") for k in stored)
    shards, gather = cs.model_shards_for_load(state, masters_from_main=with_main)
    targets = []
    if load_optim:
        optim_shards, targets = cs.optimizer_shards_for_load(state, with_main=with_main)
        shards.update(optim_shards)
    notes = []

    def prepare():
        note = adapt_padded_vocab(shards, stored, common["config"].get("vocab_size"), cfg.model,
                                  cfg.training.seed, _model_dtype(state))
        notes.extend([note] if note else [])
        dcp_io().check_shards(shards, stored)

    _check_on_every_rank(topo, prepare)
    for note in notes:
        _print0(topo, f"megafab: note: {note}")
    dcp_io().load_shards(shards, path)
    cs.gather_params(gather)
    cs.refresh_main_params(state, skip={id(t.entry) for t in targets if t.main_loaded})
    if load_optim:
        cs.apply_optimizer_state(state, targets)
        state.optimizer.iteration = common["optimizer_iteration"]
        scaler = getattr(state.optimizer, "grad_scaler", None)
        if scaler is not None and common["grad_scaler"] is not None:
            scaler.load_state_dict(common["grad_scaler"])

    if not ck.finetune:
        state.iteration = common["iteration"]
        state.consumed_train_samples = common["consumed_train_samples"]
        state.skipped_iterations = common["skipped_iterations"]
        state.nan_iterations = common["nan_iterations"]
        state.scheduler.load_state_dict(common["scheduler"])
        _load_rng(state, path, common)
    dist.barrier()
    _print0(topo, f"loaded checkpoint from {ck.load} at iteration {iteration}"
                  + (" (finetune: weights only, starting at iteration 0)" if ck.finetune else ""))
    return iteration


def _model_dtype(state) -> torch.dtype:
    return compute_dtype(state.model[0])


def _check_on_every_rank(topo, check) -> None:
    """Run `check`; if it fails on any rank, every rank raises (none is left waiting in DCP)."""
    error = None
    try:
        check()
    except CheckpointError as e:
        error = e
    failed = torch.tensor([0.0 if error is None else 1.0], device=topo.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() > 0:
        raise error or CheckpointError("the checkpoint does not match this model on another rank; "
                                       "see that rank's message")


def _load_rng(state, path: str, common: dict) -> None:
    cfg, topo = state.cfg, state.topology
    if cfg.checkpoint.no_load_rng or not common["has_rng"]:
        return
    saved, here = common["layout"], _layout(topo, cfg)
    if saved != here:
        _print0(topo, f"megafab: note: checkpoint layout {saved} differs from this run's {here}; "
                      f"RNG states are per rank, so they are not restored (dropout masks will differ)")
        return
    snap = torch.load(os.path.join(path, "rng", f"rank_{topo.rank:05d}.pt"), weights_only=True)
    cs.restore_rng(state, snap)
    state.extra[PENDING_RNG] = snap


def restore_pending_rng(state) -> None:
    """Re-apply the loaded RNG states once more. Call it after building the data iterators:
    creating a DataLoader iterator draws a seed from torch's default generator, which the
    uninterrupted run did before its first iteration, not after the checkpointed one."""
    snap = state.extra.pop(PENDING_RNG, None)
    if snap is not None:
        cs.restore_rng(state, snap)
