"""The training loop: iterate, log Megatron's lines, evaluate, checkpoint, exit on request."""

from __future__ import annotations

import math
import signal
import time

import torch
import torch.distributed as dist

from megafab.checkpoint import checkpointing
from megafab.training.batch_size import train_iterations
from megafab.training.build import (
    TrainState,
    build_model,
    build_optimizer,
    build_scheduler,
    init_distributed,
)
from megafab.training.data_setup import attach_tokenizer, build_data_iterators
from megafab.training.flops import flops_per_iteration, peak_tflops
from megafab.training.log_line import ScalarWriters, iteration_line, validation_line
from megafab.training.loop_hooks import ManualGC, StepProfiler, setup_logging
from megafab.training.step import evaluate, train_step


class _SigtermFlag:
    def __init__(self, enabled: bool):
        self.received = False
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0


def log_rank(topo) -> bool:
    """Megatron prints the iteration line on the last rank (it holds the loss)."""
    return topo.rank == topo.world_size - 1


def print_rank_0(topo, text: str) -> None:
    if topo.rank == 0:
        print(text, flush=True)


def setup(cfg) -> TrainState:
    topo, tracker = init_distributed(cfg)
    model = build_model(cfg, topo, tracker)
    optimizer = build_optimizer(cfg, topo, model)
    scheduler = build_scheduler(cfg, optimizer)
    state = TrainState(cfg, topo, tracker, model, optimizer, scheduler)
    if cfg.checkpoint.load:
        checkpointing.load_checkpoint(state)
    return state


def _should_exit(state, start_time: float, sigterm: _SigtermFlag) -> str | None:
    t = state.cfg.training
    if t.exit_signal_handler and sigterm.any_rank(state.topology.device):
        return "SIGTERM received"
    if t.exit_interval and state.iteration % t.exit_interval == 0:
        return f"exit interval {t.exit_interval}"
    if t.exit_duration_in_mins:
        elapsed = torch.tensor([(time.time() - start_time) / 60.0], device=state.topology.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if elapsed.item() > t.exit_duration_in_mins:
            return f"exit duration {t.exit_duration_in_mins} min"
    return None


def train(state: TrainState, iterators, writers: ScalarWriters, gc_control: ManualGC) -> None:
    cfg, topo = state.cfg, state.topology
    t, lg = cfg.training, cfg.logging
    total = train_iterations(cfg)
    train_iter, valid_iter, _ = iterators
    sigterm = _SigtermFlag(t.exit_signal_handler)
    profiler = StepProfiler(cfg, topo.rank, topo.device)
    start = time.time()
    peak = peak_tflops(topo.device)
    window_start, window_iters, window_samples = time.time(), 0, 0
    try:
        while state.iteration < total:
            profiler.before_step(state.iteration)
            metrics = train_step(state, train_iter)
            gc_control.after_step(state.iteration)
            window_iters += 1
            window_samples += metrics["global_batch_size"]
            if state.iteration % lg.log_interval == 0:
                _log_iteration(state, metrics, total, window_samples / window_iters,
                               (time.time() - window_start) / window_iters, peak, writers)
                window_start, window_iters, window_samples = time.time(), 0, 0
            if t.eval_interval and state.iteration % t.eval_interval == 0 and valid_iter is not None:
                with gc_control.evaluation():
                    run_evaluation(state, valid_iter, "validation", writers)
            if cfg.checkpoint.save and cfg.checkpoint.save_interval and \
                    state.iteration % cfg.checkpoint.save_interval == 0:
                checkpointing.save_checkpoint(state)
            reason = _should_exit(state, start, sigterm)
            if reason:
                if cfg.checkpoint.save and \
                        checkpointing.latest_iteration(cfg.checkpoint.save) != state.iteration:
                    checkpointing.save_checkpoint(state)
                print_rank_0(topo, f"exiting at iteration {state.iteration}: {reason}")
                return
    finally:
        profiler.stop()


def _log_iteration(state, metrics: dict, total: int, samples_per_iteration: float, elapsed: float, peak,
                   writers: ScalarWriters) -> None:
    """Megatron's iteration line (and scalars), timed over the iterations since the last one."""
    cfg, topo, lg = state.cfg, state.topology, state.cfg.logging
    tflops = flops_per_iteration(cfg, samples_per_iteration) / elapsed / topo.world_size / 1e12
    line = {"consumed_samples": state.consumed_train_samples, "elapsed_ms": elapsed * 1000,
            "tflops": tflops if lg.log_throughput else None,
            "mfu": tflops / peak if (lg.log_throughput and peak) else None,
            "tokens_per_sec": samples_per_iteration * cfg.model.seq_length / elapsed,
            "lr": state.scheduler.get_lr(), "global_batch_size": metrics["global_batch_size"],
            "lm loss": metrics["lm loss"],
            "loss_scale": state.optimizer.grad_scaler.scale if state.optimizer.grad_scaler else 1.0,
            "grad_norm": metrics["grad_norm"], "num_zeros": metrics["num_zeros"],
            "skipped": state.skipped_iterations, "nan": state.nan_iterations}
    if log_rank(topo):
        print(iteration_line(state.iteration, total, line), flush=True)
        writers.scalars(state.iteration, {
            "lm loss": metrics["lm loss"], "learning-rate": line["lr"],
            "grad-norm": metrics["grad_norm"], "loss-scale": line["loss_scale"],
            "throughput/tokens-per-sec": line["tokens_per_sec"],
            "throughput/tflops": tflops, "iteration-time-ms": line["elapsed_ms"]})


def run_evaluation(state, data_iterator, label: str, writers: ScalarWriters,
                   where: str | None = None) -> float | None:
    """where: Megatron's prefix after "<label> loss at", default "iteration N"."""
    loss = evaluate(state, data_iterator, state.cfg.training.eval_iters)
    if log_rank(state.topology):
        line = validation_line(label, where or f"iteration {state.iteration}", loss)
        print("-" * 100 + "\n" + line + "\n" + "-" * 100, flush=True)
        writers.scalars(state.iteration, {f"{label} loss": loss,
                                          f"{label} ppl": math.exp(min(loss, 60.0))})
    return loss


def pretrain(cfg) -> int:
    setup_logging(cfg.logging.logging_level)
    tokenizer = attach_tokenizer(cfg)
    state = setup(cfg)
    topo = state.topology
    print_rank_0(topo, f"megafab: {topo.world_size} process(es), tp {topo.tp} pp {topo.pp} dp {topo.dp}, "
                       f"{topo.device} / {topo.backend}")
    notes = cfg.start_up_notes()
    if cfg.training.empty_unused_memory_level and topo.device.type != "cuda":
        notes.append(f"accepted, no effect on {topo.device.type}: --empty-unused-memory-level "
                     f"(only CUDA's caching allocator holds unused memory)")
    for note in notes:
        print_rank_0(topo, f"megafab: note: {note}")
    iterators = build_data_iterators(cfg, topo, state.consumed_train_samples, tokenizer)
    checkpointing.restore_pending_rng(state)
    writers = ScalarWriters(cfg if log_rank(topo) else None, cfg.to_flat())
    gc_control = ManualGC(cfg.training)
    try:
        if not cfg.training.skip_train:
            train(state, iterators, writers, gc_control)
        total = train_iterations(cfg)
        with gc_control.evaluation():
            if iterators[1] is not None and cfg.training.eval_iters and state.iteration >= total:
                run_evaluation(state, iterators[1], "validation", writers,
                               "the end of training for val data")
            if iterators[2] is not None and cfg.training.eval_iters and state.iteration >= total:
                run_evaluation(state, iterators[2], "test", writers, "the end of training for test data")
        if cfg.checkpoint.save and state.iteration >= total and \
                checkpointing.latest_iteration(cfg.checkpoint.save) != state.iteration:
            checkpointing.save_checkpoint(state)
    finally:
        writers.close()
        gc_control.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0
