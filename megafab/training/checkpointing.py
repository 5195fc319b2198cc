"""Megatron-layout checkpoints that load into any TP/PP/DP layout, written atomically.

    SAVE/latest_checkpointed_iteration.txt     "100"  (written last)
    SAVE/iter_0000100/
        .metadata, __<rank>_0.distcp             DCP: model + optimizer tensors, global shapes
        common.json                              iteration, samples, counters, scheduler, scaler,
                                                 layout and the flat config
        rng/rank_00000.pt ...                    per global rank RNG streams (tensors, ints, lists)

Atomic save: every rank writes into SAVE/iter_0000100.tmp; after a barrier rank 0 renames it to
iter_0000100 and then replaces the tracker file (write a temp file, os.replace). A process killed
at any point leaves the tracker naming the previous complete checkpoint; a stale .tmp is removed
by the next save. Loading never unpickles code: DCP tensors and safe metadata (checkpoint_io),
JSON, and torch.load(weights_only=True) for the RNG files.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
import torch.distributed as dist

from megafab.errors import ReportedElsewhere
from megafab.training import checkpoint_files as files
from megafab.training import checkpoint_state as cs
from megafab.training.checkpoint_shard import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = files.COMMON
FORMAT_VERSION = 1
# Test hook: "ITER:SECONDS" makes rank 0 sleep before committing the save of iteration ITER, so a
# test can kill the job while only the temporary directory exists.
PAUSE_ENV = "MEGAFAB_TEST_PAUSE_BEFORE_COMMIT"
PENDING_RNG = "checkpoint_rng"


def checkpoint_io():
    """torch.distributed.checkpoint costs seconds to import; only runs that save or load pay."""
    from megafab.training import checkpoint_io as io

    return io


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(save_dir: str) -> int | None:
    """The iteration the tracker file names, or None when there is no checkpoint."""
    path = os.path.join(save_dir, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number; fix or delete the file "
                              f"(it must name an existing iter_NNNNNNN directory)") from None


def _layout(topo, cfg) -> dict:
    return {"world_size": topo.world_size, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp,
            "vpp": cfg.parallel.virtual_pipeline_model_parallel_size or 1}


def _print0(topo, text: str) -> None:
    if topo.rank == 0:
        print(text, flush=True)


# ---- save ----------------------------------------------------------------------------------------
def _common_state(state, with_optim: bool) -> dict:
    opt = state.optimizer
    scaler = getattr(opt, "grad_scaler", None)
    return {"format_version": FORMAT_VERSION, "iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "consumed_valid_samples": state.consumed_valid_samples,
            "skipped_iterations": state.skipped_iterations, "nan_iterations": state.nan_iterations,
            "scheduler": state.scheduler.state_dict(), "optimizer_iteration": opt.iteration,
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "has_optimizer": with_optim, "has_rng": not state.cfg.checkpoint.no_save_rng,
            "layout": _layout(state.topology, state.cfg), "config": state.cfg.to_flat()}


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _test_pause(iteration: int) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if spec and int(spec.split(":")[0]) == iteration:
        print(f"checkpoint: test pause before committing iteration {iteration}", flush=True)
        time.sleep(float(spec.split(":")[1]))


def commit_checkpoint(root: str, iteration: int) -> None:
    """Rank 0: make the temporary directory the checkpoint, then point the tracker at it."""
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    old = final + ".old"
    if os.path.exists(final):  # re-saving an iteration: keep the old one reachable until replaced
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    _fsync_dir(root)


def save_checkpoint(state) -> str:
    """Collective: save `state` as SAVE/iter_NNNNNNN (see the module docstring); returns the path."""
    cfg, topo = state.cfg, state.topology
    root, iteration = cfg.checkpoint.save, state.iteration
    tmp = iteration_dir(root, iteration) + ".tmp"
    start = time.time()
    with_optim = not cfg.checkpoint.no_save_optim
    shards, _ = cs.model_shards(state, for_load=False)
    if with_optim:
        shards.update(cs.optimizer_shards_for_save(state))
    if topo.rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    checkpoint_io().save_shards(shards, tmp)
    if not cfg.checkpoint.no_save_rng:
        torch.save(cs.rng_snapshot(state), os.path.join(tmp, "rng", f"rank_{topo.rank:05d}.pt"))
    if topo.rank == 0:
        _write_json(os.path.join(tmp, COMMON), _common_state(state, with_optim))
        _test_pause(iteration)
    dist.barrier()
    if topo.rank == 0:
        commit_checkpoint(root, iteration)
    dist.barrier()
    _print0(topo, f"saved checkpoint at iteration {iteration:7d} to {root} "
                  f"({time.time() - start:.1f} s)")
    return iteration_dir(root, iteration)


# ---- load ----------------------------------------------------------------------------------------
def _checkpoint_path(root: str, iteration: int) -> str:
    path = iteration_dir(root, iteration)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):  # killed mid re-save (commit_checkpoint)
        return path + ".old"
    if not os.path.isdir(path):
        raise CheckpointError(f"{os.path.join(root, TRACKER)} names iteration {iteration} but {path} does "
                              f"not exist; restore that directory or fix the tracker file")
    return path


def load_checkpoint(state) -> int | None:
    """Collective: restore `state` from --load (see the flags in CheckpointConfig); returns the
    iteration loaded, or None when the directory holds no checkpoint (training starts fresh)."""
    cfg, topo = state.cfg, state.topology
    ck = cfg.checkpoint
    root, iteration = ck.load, latest_iteration(ck.load)
    named = files.iteration_of_directory(ck.load)
    if iteration is None and named is not None and os.path.isdir(ck.load):
        root, iteration = os.path.dirname(os.path.normpath(ck.load)), named
        _print0(topo, f"megafab: note: --load {ck.load} names one checkpoint; loading iteration {named} "
                      f"of {root}")
    if iteration is None:
        _print0(topo, f"megafab: no checkpoint in {ck.load} ({TRACKER} not found); training from scratch")
        return None
    path = _checkpoint_path(root, iteration)
    common = files.read_common(path)
    metadata = files.read_dcp_metadata(path, checkpoint_io())
    if common.get("scheduler") is None and not ck.finetune:
        raise CheckpointError(f"{path} holds weights only (no iteration, scheduler or optimizer state, "
                              f"e.g. imported from HuggingFace); continue from it with --finetune")
    load_optim = not ck.finetune and not ck.no_load_optim and common["has_optimizer"]
    if not ck.finetune and not ck.no_load_optim and not common["has_optimizer"]:
        _print0(topo, "megafab: note: the checkpoint holds no optimizer state (--no-save-optim); "
                      "the optimizer starts fresh")

    shards, aliases = cs.model_shards(state, for_load=True)
    plan = []
    if load_optim:
        # A checkpoint saved from an fp32 model has no main copies; bf16 mains then take the weights.
        with_main = any(k.endswith(".main_param") for k in metadata.state_dict_metadata)
        optim_shards, plan = cs.optimizer_shards_for_load(state, with_main=with_main)
        shards.update(optim_shards)

    def check():
        if topo.rank == 0:  # the directory is shared; one rank looks at its files
            files.check_storage_files(path, metadata)
        try:
            checkpoint_io().check_shards(shards, path)
        except CheckpointError as e:
            differences = files.model_shape_differences(common.get("config", {}), cfg.model)
            if not differences:
                raise
            raise CheckpointError(f"{e}. The checkpoint's model differs from this run's: "
                                  f"{'; '.join(differences)}; give the flags it was saved with") from None

    _check_on_every_rank(topo, check)
    checkpoint_io().load_shards(shards, path)
    cs.apply_aliases(shards, aliases)
    cs.refresh_main_params(state)
    if load_optim:
        cs.apply_optimizer_blocks(state, plan)
        state.optimizer.iteration = common["optimizer_iteration"]
        scaler = getattr(state.optimizer, "grad_scaler", None)
        if scaler is not None and common["grad_scaler"] is not None:
            scaler.load_state_dict(common["grad_scaler"])

    if not ck.finetune:
        state.iteration = common["iteration"]
        state.consumed_train_samples = common["consumed_train_samples"]
        state.consumed_valid_samples = common.get("consumed_valid_samples", 0)  # older checkpoints: 0
        state.skipped_iterations = common["skipped_iterations"]
        state.nan_iterations = common["nan_iterations"]
        state.scheduler.load_state_dict(common["scheduler"])
        _load_rng(state, path, common)
    dist.barrier()
    _print0(topo, f"loaded checkpoint from {ck.load} at iteration {iteration}"
                  + (" (finetune: weights only, starting at iteration 0)" if ck.finetune else ""))
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


def _load_rng(state, path: str, common: dict) -> None:
    cfg, topo = state.cfg, state.topology
    if cfg.checkpoint.no_load_rng or not common["has_rng"]:
        return
    saved, here = common["layout"], _layout(topo, cfg)
    if saved != here:
        _print0(topo, f"megafab: note: checkpoint layout {saved} differs from this run's {here}; "
                      f"RNG states are per rank, so they are not restored (dropout masks will differ)")
        return
    try:
        snap = torch.load(files.rng_file(path, topo.rank), weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or foreign file
        raise CheckpointError(f"{files.rng_file(path, topo.rank)}: unreadable ({type(e).__name__}); restore "
                              f"it, or pass --no-load-rng", every_rank=False) from None
    cs.restore_rng(state, snap)
    state.extra[PENDING_RNG] = snap


def restore_pending_rng(state) -> None:
    """Re-apply the loaded RNG states once more. Call it after building the data iterators:
    creating a DataLoader iterator draws a seed from torch's default generator, which the
    uninterrupted run did before its first iteration, not after the checkpointed one."""
    snap = state.extra.pop(PENDING_RNG, None)
    if snap is not None:
        cs.restore_rng(state, snap)
