"""DCP's save cut in three for --async-save: plan (collective), write (the rank's writer process,
writer_process.py), finish (collective): the files are those dcp.save writes (dcp_io.save_shards),
byte layout and .metadata.

    staging = Staging()                      the rank's arena and writer, kept between saves
    staged, recipe = staging.stage(shards)   host copies of this rank's boxes (pinned on CUDA)
    write = BackgroundWrite(staged, path, objects, recipe, staging.writer())
                                             plans with every rank, then hands the writer its job
    write.done()                            this rank's files are written and fsynced (or it failed)
    write.finish()                          collective: rank 0 writes .metadata; any rank's failure
                                            raises one CheckpointError on every rank

Not dcp.async_save: it runs the whole save, planning and metadata collectives included, in its
thread or process on a process group, concurrently with training's collectives (gloo needs a
second group for that), and its stager copies the state dict, which our planner never reads.
Megatron's FileSystemWriterAsync splits DCP the same way.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.utils import _DistWrapper

from megafab.checkpoint.dcp_io import _dcp_state_dict, _ShardSavePlanner
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import Shard
from megafab.checkpoint.staging_arena import StagingArena
from megafab.checkpoint.writer_process import WriteJob, WriterProcess


class Staging:
    """The rank's staging arena (reused while the tensors' shapes hold) and its writer process,
    started at once so that it is up by the first save."""

    def __init__(self):
        self.arena: StagingArena | None = None
        self.worker: WriterProcess | None = WriterProcess()
        self.attached = False  # the worker maps the current arena
        self.buffers: dict = {}  # first key of each staged shard -> its host buffers

    def prepare(self, shards: dict[str, Shard]) -> tuple[dict, bool]:
        """An arena for `shards`' tensors (the one there if their shapes hold), mapped by the writer,
        which faults its pages in while the rank trains on: the first save then copies into memory
        that exists. Returns ({id: (first key, shard)}, on CUDA)."""
        unique = {}
        for key, shard in shards.items():
            unique.setdefault(id(shard), (key, shard))
        layout = tuple((tuple(v.shape), v.dtype) for _, s in unique.values() for v in s.views)
        cuda = any(v.device.type == "cuda" for _, s in unique.values() for v in s.views)
        if self.arena is None or self.arena.layout != layout:
            if self.arena is not None:
                self.arena.close()
            self.arena = StagingArena(layout, "cuda" if cuda else "cpu")
            self.attached = False
            self.writer()
        return unique, cuda

    def stage(self, shards: dict[str, Shard]) -> tuple[dict[str, Shard], dict]:
        """Shards whose views are host copies of `shards`' (in the arena), and the writer's recipe
        of them (key -> global shape, boxes, (offset, shape, dtype) per view, write). Shards
        shared by several keys are copied once."""
        unique, cuda = self.prepare(shards)
        copies, self.buffers, i = {}, {}, 0
        for sid, (key, shard) in unique.items():
            n = len(shard.views)
            views = self.arena.views[i:i + n]
            for dst, src in zip(views, shard.views):
                dst.copy_(src.detach(), non_blocking=src.device.type == "cuda")
            self.buffers[key] = views
            where = [(o, tuple(v.shape), v.dtype) for o, v in zip(self.arena.offsets[i:i + n], views)]
            copies[sid] = (Shard(shard.global_shape, list(shard.boxes), views, shard.write), where)
            i += n
        if cuda:
            torch.cuda.synchronize()  # GPU-only path: the non-blocking copies have landed
        staged = {key: copies[id(shard)][0] for key, shard in shards.items()}
        recipe = {key: (tuple(s.global_shape), list(s.boxes), copies[id(shards[key])][1], s.write)
                  for key, s in staged.items()}
        return staged, recipe

    def writer(self) -> WriterProcess:
        """The writer process, mapping the current arena; a new one if it has died since the last save."""
        if self.worker is not None and not self.worker.alive():
            self.worker.close()
            self.worker = None
        if self.worker is None:
            self.worker, self.attached = WriterProcess(), False
        if not self.attached:
            self.worker.attach(self.arena)
            self.attached = True
        return self.worker

    def staged_bytes(self) -> int:
        return sum(t.nbytes for views in self.buffers.values() for t in views)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None


class BackgroundWrite:
    """One rank's part of an asynchronous DCP save into `path` (see the module docstring)."""

    def __init__(self, staged: dict[str, Shard], path: str, objects: dict | None, recipe: dict,
                 worker: WriterProcess):
        self.path, self.worker, self.outcome = path, worker, None
        self.writer = FileSystemWriter(path, thread_count=1)
        self.planner = _ShardSavePlanner(staged, objects)
        self.dist = _DistWrapper(None, True, 0)
        self.metadata = None
        self.plan = self.dist.reduce_scatter("plan", self._local_plan, self._global_plan)
        worker.submit(WriteJob(path, self.dist.rank, self.plan, recipe, objects))

    def _local_plan(self):
        self.planner.set_up_planner(state_dict=_dcp_state_dict(self.planner.shards),
                                    storage_meta=self.writer.storage_meta(),
                                    is_coordinator=self.dist.is_coordinator)
        self.writer.set_up_storage_writer(self.dist.is_coordinator, rank=self.dist.rank, use_collectives=True)
        return self.writer.prepare_local_plan(self.planner.create_local_plan())

    def _global_plan(self, plans):
        plans, self.metadata = self.planner.create_global_plan(plans)
        return self.writer.prepare_global_plan(plans)

    def done(self) -> bool:
        if self.outcome is None:
            self.outcome = self.worker.poll()
        return self.outcome is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Until this rank's files are written (or the writer failed); False if `timeout` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.outcome is None:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self.outcome = self.worker.poll(0.05)
        return True

    @property
    def written_at(self) -> float:
        return self.outcome.finished

    @property
    def error(self) -> str | None:
        return self.outcome.error

    def finish(self) -> None:
        """Collective, once every rank is done(): rank 0 writes .metadata (DCP's finish), unless a
        rank's write failed: then every rank raises one CheckpointError naming the path and the
        first failure."""
        failures = self.dist.all_gather_object(self.error)
        failed = [(rank, text) for rank, text in enumerate(failures) if text is not None]
        if not failed:
            self.dist.all_reduce("write", lambda: self.outcome.results, self._finish_metadata)
            return
        rank, text = failed[0]
        raise CheckpointError(f"writing the checkpoint files into {self.path} failed on rank {rank} "
                              f"({text.splitlines()[0][:300]}){_disk_full(self.path)}")

    def _finish_metadata(self, all_results):
        self.writer.finish(metadata=self.metadata, results=all_results)
        return None


def _disk_full(path: str) -> str:
    """"; the disk is full" when the directory's file system has (nearly) no room left: a full disk
    can surface as a writer's own error (torch's zip writer: "unexpected pos") instead of ENOSPC."""
    try:
        free = shutil.disk_usage(path if os.path.isdir(path) else os.path.dirname(path)).free
    except OSError:
        return ""
    return f"; the disk is full ({free} bytes free)" if free < 1 << 20 else ""
