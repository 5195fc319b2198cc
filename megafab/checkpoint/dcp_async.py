"""DCP's save cut in three for --async-save: plan (collective), write (a background thread), finish
(collective): the files are those dcp.save writes (dcp_io.save_shards), byte layout and .metadata.

    staged = stage(shards, buffers)         host copies of this rank's boxes (pinned on CUDA)
    write = BackgroundWrite(staged, path, objects)   plans with every rank, then writes in a thread
    write.done()                            this rank's files are written and fsynced (or it failed)
    write.finish()                          collective: rank 0 writes .metadata; any rank's failure
                                            raises one CheckpointError on every rank

Not dcp.async_save: it runs the whole save, planning and metadata collectives included, in its
thread on a process group, concurrently with training's collectives (gloo needs a second group
for that), and its stager copies the state dict, which our planner never reads. Megatron's
FileSystemWriterAsync splits DCP the same way.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.utils import _DistWrapper

from megafab.checkpoint.dcp_io import _dcp_state_dict, _ShardSavePlanner
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import Shard


def _host_copy(view: torch.Tensor, reuse: torch.Tensor | None) -> torch.Tensor:
    if reuse is None or reuse.shape != view.shape or reuse.dtype != view.dtype:
        reuse = torch.empty(view.shape, dtype=view.dtype, pin_memory=view.device.type == "cuda")
    return reuse.copy_(view.detach(), non_blocking=view.device.type == "cuda")


def stage(shards: dict[str, Shard], buffers: dict) -> dict[str, Shard]:
    """Shards whose views are host copies of `shards`' (each its own exact-size storage, so DCP
    writes them without another copy); `buffers` (key -> tensors) keeps them for the next save,
    which reuses them when the shapes match. Shards shared by several keys are copied once."""
    staged, seen = {}, {}
    for key, shard in shards.items():
        if id(shard) not in seen:
            old = buffers.get(key, [])
            views = [_host_copy(v, old[i] if i < len(old) else None) for i, v in enumerate(shard.views)]
            buffers[key] = views
            seen[id(shard)] = Shard(shard.global_shape, list(shard.boxes), views, shard.write)
        staged[key] = seen[id(shard)]
    if any(v.device.type == "cuda" for s in shards.values() for v in s.views):
        torch.cuda.synchronize()  # GPU-only path: the non-blocking copies have landed
    return staged


def staged_bytes(buffers: dict) -> int:
    return sum(t.nbytes for views in buffers.values() for t in views)


class BackgroundWrite:
    """One rank's part of an asynchronous DCP save into `path` (see the module docstring)."""

    def __init__(self, staged: dict[str, Shard], path: str, objects: dict | None = None):
        self.path, self.error, self.results = path, None, None
        self.writer = FileSystemWriter(path, thread_count=1)
        self.planner = _ShardSavePlanner(staged, objects)
        self.dist = _DistWrapper(None, True, 0)
        self.metadata = None
        self.plan = self.dist.reduce_scatter("plan", self._local_plan, self._global_plan)
        self.started = time.time()
        self.written_at = None
        self.thread = threading.Thread(target=self._write, name="megafab-checkpoint-writer", daemon=True)
        self.thread.start()

    def _local_plan(self):
        self.planner.set_up_planner(state_dict=_dcp_state_dict(self.planner.shards),
                                    storage_meta=self.writer.storage_meta(),
                                    is_coordinator=self.dist.is_coordinator)
        self.writer.set_up_storage_writer(self.dist.is_coordinator, rank=self.dist.rank, use_collectives=True)
        return self.writer.prepare_local_plan(self.planner.create_local_plan())

    def _global_plan(self, plans):
        plans, self.metadata = self.planner.create_global_plan(plans)
        return self.writer.prepare_global_plan(plans)

    def _write(self) -> None:
        try:
            future = self.writer.write_data(self.planner.finish_plan(self.plan), self.planner)
            future.wait()
            self.results = future.value()
        except BaseException as e:  # noqa: BLE001 - reported to every rank by finish()
            self.error = e
        finally:
            if hasattr(self.planner, "progress"):
                self.planner.progress.close()
            self.written_at = time.time()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> None:
        self.thread.join()

    def finish(self) -> None:
        """Collective, once every rank is done(): rank 0 writes .metadata (DCP's finish), unless a
        rank's write failed: then every rank raises one CheckpointError naming the path and the
        first failure."""
        failures = self.dist.all_gather_object(None if self.error is None else
                                               f"{type(self.error).__name__}: {self.error}")
        failed = [(rank, text) for rank, text in enumerate(failures) if text is not None]
        if not failed:
            self.dist.all_reduce("write", lambda: self.results, self._finish_metadata)
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
