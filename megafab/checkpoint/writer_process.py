"""The persistent checkpoint writer of --async-save (Megatron's --use-persistent-ckpt-worker): one
process per rank, spawned when training starts, that maps the rank's staging arena
(staging_arena.py; its file descriptor passed over the pipe) and writes each save's files with
DCP's FileSystemWriter while the rank trains. Spawned, not forked: a forked child would keep the
copy-on-write image of the rank's whole memory (on CPU the model and optimizer state) for as long
as it lives. It runs at a lower CPU priority, ignores SIGTERM and SIGINT (the rank decides when to
stop) and dies with its rank (PR_SET_PDEATHSIG on Linux; EOF on its pipe); a writer that dies
mid-write fails that save, which is then never finalized.

    worker = WriterProcess()            spawn; returns at once (jobs wait until it is up)
    worker.attach(arena)                the arena the next jobs' offsets point into
    worker.submit(job)                  WriteJob: where, the rank's DCP plan, offsets, objects
    worker.poll()                       None while writing, else Outcome(results | error, finished)
    worker.close()
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.reduction import recv_handle, send_handle

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from megafab.checkpoint.dcp_io import _dcp_state_dict, _ShardSavePlanner
from megafab.checkpoint.layout import Shard
from megafab.checkpoint.staging_arena import StagingArena, view_at
from megafab.run.signals import ignore_sigterm

PR_SET_PDEATHSIG = 1
NICENESS = 10  # the writer yields the CPU to training (on a CPU run both compete for the same cores)


@dataclass
class WriteJob:
    path: str
    rank: int
    plan: object  # the rank's SavePlan, as DCP's global planning returned it
    recipe: dict  # key -> (global_shape, boxes, [(offset, shape, dtype)], write)
    objects: dict | None


@dataclass
class Outcome:
    results: list | None  # DCP's WriteResults of the rank's files
    error: str | None
    finished: float


def run_job(block: torch.Tensor, job: WriteJob) -> list:
    """In the writer: this rank's files of one save, from the tensors at the job's offsets."""
    shards = {key: Shard(shape, list(boxes), [view_at(block, *v) for v in views], write)
              for key, (shape, boxes, views, write) in job.recipe.items()}
    writer = FileSystemWriter(job.path, thread_count=1)
    writer.set_up_storage_writer(False, rank=job.rank, use_collectives=True)
    planner = _ShardSavePlanner(shards, job.objects)
    planner.set_up_planner(state_dict=_dcp_state_dict(shards), storage_meta=None, is_coordinator=False)
    plan = planner.finish_plan(job.plan)
    try:
        future = writer.write_data(plan, planner)
        future.wait()
        return future.value()
    finally:
        planner.progress.close()


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the rank died before the line above took effect
        os._exit(1)


def serve(conn, parent: int) -> None:
    """The writer's main loop: one message at a time, until the rank says stop or is gone."""
    _die_with_parent(parent)
    ignore_sigterm(interrupt=True)
    os.nice(NICENESS)
    torch.set_num_threads(1)
    block = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if isinstance(message, int):  # a new arena of this many bytes; its descriptor follows
            fd = recv_handle(conn)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault every page in now
            block = torch.frombuffer(mmap.mmap(fd, message, flags=flags), dtype=torch.uint8)
            os.close(fd)  # the mapping keeps the memory
            continue
        try:
            outcome = Outcome(run_job(block, message), None, 0.0)
        except BaseException as e:  # noqa: BLE001 - reported to every rank by the save's finish
            outcome = Outcome(None, f"{type(e).__name__}: {e}", 0.0)
        outcome.finished = time.time()
        conn.send(outcome)


def _ended(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class WriterProcess:
    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, os.getpid()), name="megafab-checkpoint-writer",
                                   daemon=True)
        self.process.start()
        child.close()

    def attach(self, arena: StagingArena) -> None:
        self.conn.send(arena.size)
        send_handle(self.conn, arena.fd, self.process.pid)

    def alive(self) -> bool:
        return self.process.is_alive()

    def submit(self, job: WriteJob) -> None:
        self.conn.send(job)

    def poll(self, timeout: float = 0.0) -> Outcome | None:
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        if self.process.is_alive():
            return None
        self.process.join(1.0)
        return Outcome(None, f"the checkpoint writer process (pid {self.process.pid}) "
                             f"{_ended(self.process.exitcode)} before its files were written", time.time())

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
        self.conn.close()
