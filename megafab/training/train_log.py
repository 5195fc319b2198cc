"""What the training loop reports, and when (Megatron's schedule):

- every --log-interval iterations and after the run's first one (as Megatron 0.16): Megatron's
  iteration line (+ ETA) on the last rank, the same values as one JSON line (--metrics-jsonl), the
  timers (--timing-log-level) and, after the first logged iterations, the memory line; the losses
  are means over the window's applied iterations (TrainingLog._log_iteration);
- every --tensorboard-log-interval iterations: the scalars under Megatron's TensorBoard tags and
  each "<tag> vs samples", to wandb as well (TrainingLog._step_scalars); an MoE model's balancing
  losses every iteration;
- after each evaluation: Megatron's validation line, "lm loss validation" (+ "ppl" with
  --log-validation-ppl-to-tensorboard), and its JSON line.
"""

from __future__ import annotations

import math
import os
import time

from megafab.plan.flops import flops_per_iteration, peak_tflops
from megafab.timers import Timers
from megafab.training.batch_size import train_iterations
from megafab.training.log_line import MetricsJSONL, ScalarWriters, iteration_line, timestamp, validation_line
from megafab.training.run_record import MemoryReport, memory_usage, run_directory
from megafab.training.step import nan_iteration

METRICS_JSONL = "metrics.jsonl"


def log_rank(topo) -> bool:
    """Megatron prints the iteration line on the last rank (it holds the loss)."""
    return topo.rank == topo.world_size - 1


def metrics_path(cfg) -> str | None:
    """--metrics-jsonl, else metrics.jsonl beside the run's other records (run_directory)."""
    if cfg.logging.metrics_jsonl:
        return cfg.logging.metrics_jsonl
    directory = run_directory(cfg)
    return os.path.join(directory, METRICS_JSONL) if directory else None


class TrainingLog:
    """The loop's reporter; every rank holds one (timers are gathered from all ranks)."""

    def __init__(self, cfg, topo, start_iteration: int):
        self.cfg, self.topo = cfg, topo
        speaks = log_rank(topo)
        self.writers = ScalarWriters(cfg if speaks else None, cfg.to_flat())
        self.jsonl = MetricsJSONL(metrics_path(cfg) if speaks else None)
        lg = cfg.logging
        self.timers = Timers(lg.timing_log_level, lg.timing_log_option, topo.device)
        self.memory = MemoryReport(start_iteration)
        self.first_iteration = start_iteration + 1
        self.total = train_iterations(cfg)
        self.peak = peak_tflops(topo.device)
        self._window(time.time())

    def _window(self, now: float) -> None:
        self.window_start, self.window_iters, self.window_samples = now, 0, 0
        self.window_moe: dict[str, float] = {}  # balancing-loss sums since the last line
        self.window_loss, self.window_applied, self.window_skipped, self.window_nan = 0.0, 0, 0, 0

    def after_step(self, state, metrics: dict) -> None:
        """Called by every rank after each training step."""
        self.window_iters += 1
        self.window_samples += metrics["global_batch_size"]
        # Megatron's total_loss_dict order: the MoE losses, then the MTP depths' (`mtp_1 loss`, ...)
        moe = {**(metrics.get("moe_losses") or {}), **(metrics.get("mtp_losses") or {})}
        for name, value in moe.items():
            if not name.startswith("moe/"):  # --moe-per-layer-logging's go to TensorBoard only
                self.window_moe[name] = self.window_moe.get(name, 0.0) + value
        if metrics["update_ok"]:
            self.window_applied += 1
            self.window_loss += metrics["lm loss"] or 0.0  # None off the last stage
        else:
            self.window_skipped += 1
        self.window_nan += nan_iteration(metrics["grad_norm"])
        lg = self.cfg.logging
        on_scalars = state.iteration % lg.tensorboard_log_interval == 0
        on_interval = state.iteration % lg.log_interval == 0
        on_line = on_interval or state.iteration == self.first_iteration
        # every rank takes part (the same iterations on all); Megatron computes it every iteration
        # and reports it on these
        norm = state.optimizer.params_norm(self.cfg.precision.fp16) \
            if lg.log_params_norm and (on_scalars or on_line) else None
        metrics = {**metrics, "params_norm": norm}
        if log_rank(self.topo) and moe:  # Megatron's track_moe_metrics: every iteration, its names
            self.writers.scalars(state.iteration, moe)
        if log_rank(self.topo) and on_scalars:
            self._step_scalars(state, metrics)
        if on_line:
            now = time.time()
            self._log_iteration(state, metrics, (now - self.window_start) / self.window_iters, on_interval)
            if on_interval:
                self._window(time.time())

    def _step_scalars(self, state, metrics: dict) -> None:
        """Megatron's TensorBoard tags: learning-rate, batch-size, lm loss, loss-scale, grad-norm,
        params-norm (--log-params-norm), ..., each also "<tag> vs samples". An MoE model's
        balancing losses go out every iteration as load_balancing_loss, z_loss, ... (in the line
        and JSON averaged over the logged iterations, as Megatron's)."""
        lg = self.cfg.logging
        scaler = state.optimizer.grad_scaler
        loss_scale = scaler.scale if scaler else 1.0
        values = {"learning-rate": state.scheduler.get_lr(), "batch-size": metrics["global_batch_size"],
                  "lm loss": metrics["lm loss"],
                  "loss-scale": loss_scale if lg.log_loss_scale_to_tensorboard else None,
                  "world-size": self.topo.world_size if lg.log_world_size_to_tensorboard else None,
                  "grad-norm": metrics["grad_norm"], "num-zeros": metrics["num_zeros"],
                  "params-norm": metrics["params_norm"]}
        self.writers.scalars(state.iteration, values, state.consumed_train_samples)
        if lg.log_memory_to_tensorboard:
            usage = memory_usage(self.topo.device)
            self.writers.scalars(state.iteration, {f"mem-{k.replace(' ', '-')}-bytes": v * 2**20
                                                   for k, v in usage.items()}, wandb=False)

    def _log_iteration(self, state, metrics: dict, elapsed: float, closes_window: bool) -> None:
        """The iteration line timed over the iterations since the last one; then memory and timers.
        As Megatron's total_loss_dict, the lm loss (and an MoE model's balancing losses) is the
        mean over the window's applied iterations, the skipped and nan counts are the window's; the
        first iteration's line does not close the window (at --log-interval 1 every line is one
        iteration's: Megatron 0.16.1 then prints the mean of iterations 1 and 2 at iteration 2)."""
        cfg, topo, lg = self.cfg, self.topo, self.cfg.logging
        samples_per_iteration = self.window_samples / self.window_iters
        tflops = flops_per_iteration(cfg, samples_per_iteration) / elapsed / topo.world_size / 1e12
        scaler = state.optimizer.grad_scaler
        line = {"consumed_samples": state.consumed_train_samples, "elapsed_ms": elapsed * 1000,
                "tflops": tflops if lg.log_throughput else None,
                "mfu": tflops / self.peak if (lg.log_throughput and self.peak) else None,
                "tokens_per_sec": samples_per_iteration * cfg.model.seq_length / elapsed,
                "lr": state.scheduler.get_lr(), "global_batch_size": metrics["global_batch_size"],
                "lm loss": (self.window_loss / max(1, self.window_applied)
                            if metrics["lm loss"] is not None else None),
                "loss_scale": scaler.scale if scaler else 1.0,
                "grad_norm": metrics["grad_norm"], "num_zeros": metrics["num_zeros"],
                "params_norm": metrics["params_norm"], "skipped": self.window_skipped, "nan": self.window_nan,
                "eta_s": (self.total - state.iteration) * elapsed}
        if log_rank(topo):
            when = timestamp()
            # as Megatron's total_loss_dict: the balancing losses averaged over the logged iterations
            moe = {name: total / self.window_iters for name, total in self.window_moe.items()}
            print(iteration_line(state.iteration, self.total, line, when, losses=moe), flush=True)
            self.jsonl.write({"kind": "iteration", "time": when, "iteration": state.iteration,
                              "train_iters": self.total, **line, **moe})
            if lg.log_timers_to_tensorboard and closes_window:  # TensorBoard keeps the interval
                self.writers.scalars(state.iteration, {"iteration-time": elapsed,
                                                       "throughput": tflops if lg.log_throughput else None})
            self.writers.scalars(state.iteration, {"throughput/tokens-per-sec": line["tokens_per_sec"]})
        self.memory.after_log(topo, state.iteration)
        text, maxima = self.timers.report(self.window_iters, reset=closes_window)  # collective: every rank
        if log_rank(topo) and text:
            print(text, flush=True)
            if lg.log_timers_to_tensorboard and closes_window:
                self.writers.scalars(state.iteration, {f"{k}-time": v for k, v in maxima.items()})

    def record(self, fields: dict) -> None:
        """One more line of metrics.jsonl (written by the logging rank; `fields` has its "kind")."""
        self.jsonl.write({"time": timestamp(), **fields})

    def evaluation(self, state, label: str, where: str, loss: float | None) -> None:
        """Megatron's evaluation block and tags: "lm loss validation" (the test set: "lm loss test")."""
        if not log_rank(self.topo):
            return
        line = validation_line(label, where, loss)
        print("-" * 100 + "\n" + line + "\n" + "-" * 100, flush=True)
        ppl = math.exp(min(20.0, loss))
        self.jsonl.write({"kind": label, "time": timestamp(), "iteration": state.iteration, "where": where,
                          "lm loss": loss, "lm loss PPL": ppl})
        tag = "lm loss validation" if label == "validation" else f"lm loss {label}"
        with_ppl = self.cfg.logging.log_validation_ppl_to_tensorboard
        values = {tag: loss, f"{tag} ppl": ppl if with_ppl else None}
        self.writers.scalars(state.iteration, values, state.consumed_train_samples)

    def close(self) -> None:
        self.writers.close()
        self.jsonl.close()
