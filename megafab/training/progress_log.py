"""--log-progress: Megatron's SAVE/progress.txt, one tab-separated line per event, appended by rank 0:
`<%Y-%m-%d %H:%M:%S>\tJob ID: <SLURM_JOB_ID or empty>\t# GPUs: <world size>\t<event>`. Events:
"Starting job" at start; after each persistent save through the loop "Saved checkpoint" (or, with
--async-save, "Saving async checkpoint") with the iteration, this job's and the cumulative TFLOP/s per
GPU, the floating-point operations so far and the tokens in billions; "Saved async checkpoint" once an
asynchronous save is finalized; "Deleted checkpoint" for each one --save-retain-interval deletes
(Megatron's append_to_progress_log, compute_throughputs_and_append_to_progress_log in training.py,
checkpointing.py's finalize and delete functions). The cumulative throughput is read back
from the file (get_start_time_from_progress_log): since the first "Starting job" of the latest run of
jobs with this world size, counting from the FLOPs of the last committed checkpoint before it.
"""

from __future__ import annotations

import os
import time
from datetime import datetime

import torch.distributed as dist

FILE = "progress.txt"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
STARTING, SAVED, SAVING_ASYNC, SAVED_ASYNC = ("Starting job", "Saved checkpoint", "Saving async checkpoint",
                                             "Saved async checkpoint")
DELETED = "Deleted checkpoint"


def _field(token: str, kind):
    return kind(token.split(": ")[1])


def start_from_progress_log(path: str, world_size: int) -> tuple[datetime, float]:
    """Megatron's get_start_time_from_progress_log: (the time of the first "Starting job" since the
    world size last changed, the FLOPs of the latest committed save before it)."""
    start_time = start_flops = None
    latest, uncommitted = 0.0, None
    with open(path) as f:
        for line in f:
            tokens = line.strip().split("\t")
            if tokens[3] == SAVED:
                latest = _field(tokens[7], float)
            elif tokens[3] == SAVING_ASYNC:
                uncommitted = _field(tokens[7], float)
            elif tokens[3] == SAVED_ASYNC and uncommitted is not None:
                latest, uncommitted = uncommitted, None
            if _field(tokens[2], int) != world_size:
                start_time = start_flops = None
                continue
            if tokens[3] == STARTING and start_time is None:
                start_time, start_flops = tokens[0], latest
    assert start_time is not None, f"{path} has no 'Starting job' line of world size {world_size}"
    return datetime.strptime(start_time, TIME_FORMAT), start_flops


class ProgressLog:
    """The run's progress.txt (every rank holds one; rank 0 writes). Off without --log-progress or --save."""

    def __init__(self, cfg, topo, start_flops: float = 0.0, job_start: float | None = None):
        """start_flops: the FLOPs so far when this job started (its loaded checkpoint's); job_start:
        the job's start (time.time())."""
        self.save = cfg.checkpoint.save if cfg.logging.log_progress else None
        self.topo, self.seq_length, self.async_save = topo, cfg.model.seq_length, cfg.checkpoint.async_save
        self.start_flops, self.job_start = start_flops, time.time() if job_start is None else job_start

    @property
    def path(self) -> str:
        return os.path.join(self.save, FILE)

    def append(self, text: str, barrier: bool = True) -> None:
        """Megatron's append_to_progress_log (collective with `barrier`)."""
        if self.save is None:
            return
        if barrier:
            dist.barrier()
        if self.topo.rank == 0:
            os.makedirs(self.save, exist_ok=True)
            with open(self.path, "a+") as f:
                f.write(f"{datetime.now().strftime(TIME_FORMAT)}\tJob ID: {os.getenv('SLURM_JOB_ID', '')}\t"
                        f"# GPUs: {self.topo.world_size}\t{text}\n")

    def after_save(self, state) -> None:
        """Collective: after a persistent save through the loop, its throughput line. The cumulative
        rate's seconds are whole (the file's timestamps are): at least one is counted (Megatron
        divides by zero when a save falls within the second its job of this world size started)."""
        if self.save is None:
            return
        world, flops = self.topo.world_size, state.num_floating_point_operations_so_far
        text = None
        if self.topo.rank == 0:
            job = (flops - self.start_flops) / ((time.time() - self.job_start) * 1e12 * world)
            started, started_flops = start_from_progress_log(self.path, world)
            elapsed = max((datetime.now() - started).total_seconds(), 1.0)
            cumulative = (flops - started_flops) / (elapsed * 1e12 * world)
            tokens = state.consumed_train_samples * self.seq_length
            text = (f"{SAVING_ASYNC if self.async_save else SAVED}\tIteration: {state.iteration}\t"
                    f"Job throughput: {job:.1f} TFLOP/s/GPU\t"
                    f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                    f"Floating-point operations: {flops:.2e}\t"
                    f"Tokens (in billions): {tokens / 10**9:.2f}")
        self.append(text)

    def saved_async(self, iteration: int, retired: int | None = None) -> None:
        """An asynchronous save was finalized, and then (rank 0) --save-retain-interval deleted
        `retired` (Megatron writes both without a barrier)."""
        self.append(f"{SAVED_ASYNC}\tIteration: {iteration}", barrier=False)
        if retired is not None:
            self.deleted(retired)

    def deleted(self, iteration: int) -> None:
        """Rank 0: --save-retain-interval deleted this iteration's checkpoint."""
        self.append(f"{DELETED}\tIteration: {iteration}", barrier=False)
