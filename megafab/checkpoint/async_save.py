"""--async-save: a torch_dist save that stalls training only while each rank copies what it owns to
host memory; the rank's writer process (dcp_async.py, writer_process.py) writes the files into
SAVE/iter_N.tmp, and the
checkpoint is finalized (DCP's .metadata, common.pt, metadata.json, the rename and the tracker:
directory.py's commit) only once every rank's files are written and fsynced, all ranks agreeing
in a collective. A crash at any moment before the tracker is replaced leaves the previous checkpoint
the latest. The checkpoint is the one the synchronous save writes (checkpointing.dcp_parts).

    saver = AsyncSaver()
    saver.schedule(state)                   collective: stage, plan, start the writer
    saver.maybe_finalize(topo)              collective, at a safe point of the loop (Megatron's
                                            maybe_finalize_async_save): finalize once all are done
    saver.maybe_finalize(topo, blocking=True)   wait for it (the next save, exit, end of training)
    saver.abandon(topo)                     an error: wait for this rank's writer, commit nothing
    saver.close()                           the writer process ends (end of training)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megafab.checkpoint import checkpointing, megatron_dist
from megafab.checkpoint import state as cs
from megafab.checkpoint.directory import commit_checkpoint, iteration_dir, latest_iteration, retain_interval
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.source import rng_file

ABANDON_WAIT_S = 30.0


def dcp_async():
    # deferred: torch.distributed.checkpoint costs seconds to import; only saves and loads pay it
    from megafab.checkpoint import dcp_async as io

    return io


@dataclass
class Pending:
    iteration: int
    root: str
    tmp: str
    write: object  # dcp_async.BackgroundWrite
    common: dict | None  # rank 0's common.pt, as it was at the save
    started: float
    stall_s: float
    staged_max: int  # the most bytes any rank staged in host memory for this save
    retain: int | None = None  # --save-retain-interval where root is --save
    manifest: bool = False  # --verify-integrity


def _print0(topo, text: str) -> None:
    if topo.rank == 0:
        print(text, flush=True)


def _previous(root: str) -> str:
    latest = latest_iteration(root)
    return "no checkpoint yet" if latest is None else f"iteration {latest}"


class AsyncSaver:
    """The run's asynchronous saves: at most one pending; host staging memory and the writer
    process kept between saves."""

    def __init__(self, on_finalized=None):
        """on_finalized(iteration, retired): called on every rank once a save is finalized; retired: on
        rank 0 the iteration --save-retain-interval deleted then, else None."""
        self.pending: Pending | None = None
        self.on_finalized = on_finalized
        self.staging = dcp_async().Staging()  # its writer process starts now, up by the first save

    @property
    def buffers(self) -> dict:
        return {} if self.staging is None else self.staging.buffers

    @property
    def pending_iteration(self) -> int | None:
        return None if self.pending is None else self.pending.iteration

    def staged_bytes(self) -> int:
        return 0 if self.staging is None else self.staging.staged_bytes()

    def prepare(self, state) -> None:
        """Collective where the save's parts are: size the host staging memory for `state` now (after
        the first step, when the optimizer state exists), so that the first save does not wait for it."""
        if self.staging is None:
            self.staging = dcp_async().Staging()
        shards, _, _ = checkpointing.dcp_parts(state, not state.cfg.checkpoint.no_save_optim)
        self.staging.prepare(shards)

    def schedule(self, state, root: str | None = None) -> None:
        """Collective: stage `state` to host memory and start writing it as ROOT/iter_N (ROOT: --save)."""
        topo, ck = state.topology, state.cfg.checkpoint
        root = root or ck.save
        if self.pending is not None:
            _print0(topo, "WARNING: Starting a checkpoint save before previous has finished. Consider "
                          "increasing the checkpoint interval.")
            self.maybe_finalize(topo, blocking=True)
        start = time.time()
        tmp = checkpointing.start_save(state, root)
        shards, objects, common = checkpointing.dcp_parts(state, not ck.no_save_optim)
        if self.staging is None:  # closed by an earlier end of training
            self.staging = dcp_async().Staging()
        staged, recipe = self.staging.stage(shards)
        if not ck.no_save_rng:
            torch.save(cs.rng_snapshot(state), rng_file(tmp, topo.rank))
        write = dcp_async().BackgroundWrite(staged, tmp, objects, recipe, self.staging.writer())  # collective
        most = torch.tensor([self.staged_bytes()], dtype=torch.int64, device=topo.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        self.pending = Pending(state.iteration, root, tmp, write, common, start, time.time() - start,
                               int(most.item()), retain_interval(ck, root), ck.verify_integrity)
        _print0(topo, f"scheduled an async checkpoint save at iteration {state.iteration:7d} to {root} "
                      f"({self.pending.stall_s:.1f} s to stage {self.staged_bytes() / 2**20:.1f} MiB on "
                      f"rank 0, at most {self.pending.staged_max / 2**20:.1f} MiB on a rank, kept in host "
                      f"memory for the next save)")

    def maybe_finalize(self, topo, blocking: bool = False) -> bool:
        """Collective while a save is pending: finalize it if every rank's writer is done (blocking:
        wait for them); True when it was finalized here."""
        p = self.pending
        if p is None:
            return False
        if blocking:
            p.write.wait()
        done = torch.tensor([1.0 if p.write.done() else 0.0], device=topo.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() < 1.0:
            return False
        self.pending = None
        try:
            p.write.finish()  # rank 0 writes DCP's .metadata; a rank's failure raises on every rank
        except CheckpointError as e:
            raise CheckpointError(f"{e}; the asynchronous save of iteration {p.iteration} is dropped and "
                                  f"{_previous(p.root)} stays the latest in {p.root}: free space or fix "
                                  f"the directory's permissions, then resume") from None
        retired = []
        _on_rank0_everywhere(topo, lambda: retired.append(_commit(p)), p)
        _print0(topo, f"saved checkpoint at iteration {p.iteration:7d} to {p.root} in torch_dist format "
                      f"(async: {p.stall_s:.1f} s stalled training, written in "
                      f"{p.write.written_at - p.started:.1f} s, finalized after "
                      f"{time.time() - p.started:.1f} s)")
        if self.on_finalized is not None:
            self.on_finalized(p.iteration, retired[0] if retired else None)
        return True

    def abandon(self, topo) -> None:
        """The run stops with an error: wait (a while) for this rank's writer; commit nothing, so
        the previous checkpoint stays the latest (no collective: other ranks may be gone)."""
        p, self.pending = self.pending, None
        if p is None:
            return
        p.write.wait(ABANDON_WAIT_S)
        self.close()
        _print0(topo, f"megafab: note: the run stopped before the asynchronous save of iteration "
                      f"{p.iteration} was finalized; {_previous(p.root)} stays the latest in {p.root}")


    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None


def _commit(p: Pending) -> int | None:
    if p.common is not None:
        megatron_dist.write_common(p.tmp, p.common)  # common.pt, then metadata.json
    return commit_checkpoint(p.root, p.iteration, p.retain, p.manifest)


def _on_rank0_everywhere(topo, action, p: Pending) -> None:
    """Rank 0 runs `action`; if it fails, every rank stops with one message (none waits forever)."""
    problem = None
    if topo.rank == 0:
        try:
            action()
        except OSError as e:
            problem = f"{type(e).__name__}: {e}"
    failed = torch.tensor([0.0 if problem is None else 1.0], device=topo.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() > 0:
        raise CheckpointError(
            f"finalizing the checkpoint of iteration {p.iteration} in {iteration_dir(p.root, p.iteration)} "
            f"failed on rank 0 ({problem or 'see rank 0'}); {_previous(p.root)} stays the latest in "
            f"{p.root}: free space or fix the directory's permissions, then resume")
