"""What the training loop does around its steps on request: Python's garbage collector
(--manual-gc), the CUDA cache (--empty-unused-memory-level), torch.profiler (--profile) and the
logging level (--logging-level). Megatron's placement of each is kept.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import torch


def setup_logging(level: int | None) -> None:
    """--logging-level: the level of the root logger (Megatron sets the same), megafab's included."""
    if level is None:
        return
    logging.basicConfig(level=level)
    logging.getLogger().setLevel(level)


class ManualGC:
    """--manual-gc: the automatic collector is off; every rank collects at the same steps (every
    --manual-gc-interval iterations, and before and after evaluation unless --no-manual-gc-eval),
    so no rank pauses alone while the others wait for it in a collective."""

    def __init__(self, training_cfg):
        self.enabled = training_cfg.manual_gc
        self.interval = training_cfg.manual_gc_interval
        self.around_eval = training_cfg.manual_gc_eval
        if self.enabled:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self):
        if self.enabled and self.around_eval:
            gc.collect()
        yield
        if self.enabled and self.around_eval:
            gc.collect()

    def close(self) -> None:
        if self.enabled:
            gc.enable()


def empty_unused_memory(level: int, needed: int, device: torch.device) -> None:
    """Release the CUDA caching allocator's unused blocks when --empty-unused-memory-level >= needed
    (1: after forward-backward and each evaluation step, 2: also after the optimizer step)."""
    if level >= needed and device.type == "cuda":
        torch.cuda.empty_cache()


def profile_dir(cfg) -> str:
    """Where the trace goes: beside the TensorBoard logs (Megatron's choice), else the checkpoints."""
    if cfg.logging.tensorboard_dir:
        return cfg.logging.tensorboard_dir
    return os.path.join(cfg.checkpoint.save, "profile") if cfg.checkpoint.save else "profile"


class StepProfiler:
    """--profile: torch.profiler over the iterations that start with --profile-step-start
    iterations done and end with --profile-step-end done, on the ranks of --profile-ranks. The
    trace (TensorBoard's profiler plugin reads it; chrome://tracing too) is written to
    profile_dir(cfg) as rank<R>.<time>.pt.trace.json. Without --use-pytorch-profiler, on CUDA, the
    same range is also marked for nsys (cudaProfilerStart/Stop, Megatron's --profile)."""

    def __init__(self, cfg, rank: int, device: torch.device):
        lg = cfg.logging
        self.enabled = lg.profile and rank in lg.profile_ranks
        self.start_at, self.end_at = lg.profile_step_start, lg.profile_step_end
        self.nsys = not lg.use_pytorch_profiler and device.type == "cuda"
        self.dir, self.rank, self.device = profile_dir(cfg), rank, device
        self.profiler = None

    def before_step(self, iteration: int) -> None:
        """iteration: steps completed so far."""
        if not self.enabled:
            return
        if iteration == self.start_at and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            os.makedirs(self.dir, exist_ok=True)
            trace = torch.profiler.tensorboard_trace_handler(self.dir, worker_name=f"rank{self.rank}")
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                                   on_trace_ready=trace)
            self.profiler.start()
            if self.nsys:
                torch.cuda.profiler.start()
        elif iteration == self.end_at:
            self.stop()

    def stop(self) -> None:
        """Write the trace (also when training ends inside the profiled range)."""
        if self.profiler is not None:
            if self.nsys:
                torch.cuda.profiler.stop()
            self.profiler.stop()
            self.profiler = None
