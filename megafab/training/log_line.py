"""The log lines Megatron users already parse, their JSON-lines twin, and optional TensorBoard /
wandb writers (Megatron's tag names)."""

from __future__ import annotations

import datetime
import json
import math
import os
import time

from megafab.run.packages import import_optional


def timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=max(0, round(seconds))))


def iteration_line(iteration: int, train_iters: int, metrics: dict, when: str | None = None,
                   losses: dict | None = None) -> str:
    """` [time] iteration N/ T | consumed samples: ... | ... |` in Megatron's order and format, then
    megafab's estimate of the time left (` ETA: H:MM:SS |`, from the recent iterations' pace).
    losses: more losses after the lm loss, as Megatron prints its MoE ones (`z_loss: ... |`)."""
    parts = [f" [{when or timestamp()}] iteration {iteration:8d}/{train_iters:8d}",
             f" consumed samples: {metrics['consumed_samples']:12d}",
             f" elapsed time per iteration (ms): {metrics['elapsed_ms']:.1f}"]
    if metrics.get("tflops") is not None:
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {metrics['tflops']:.1f}")
    if metrics.get("mfu") is not None:
        parts.append(f" MFU: {100 * metrics['mfu']:.1f}%")
    parts.append(f" tokens per second: {metrics['tokens_per_sec']:.1f}")
    parts.append(f" learning rate: {metrics['lr']:.6E}")
    parts.append(f" global batch size: {metrics['global_batch_size']:5d}")
    if metrics.get("lm loss") is not None:
        parts.append(f" lm loss: {metrics['lm loss']:.6E}")
    parts += [f" {name}: {value:.6E}" for name, value in (losses or {}).items()]
    parts.append(f" loss scale: {metrics['loss_scale']:.1f}")
    if metrics.get("grad_norm") is not None:
        parts.append(f" grad norm: {metrics['grad_norm']:.3f}")
    if metrics.get("num_zeros") is not None:
        parts.append(f" num zeros: {metrics['num_zeros']:.1f}")
    if metrics.get("params_norm") is not None:
        parts.append(f" params norm: {metrics['params_norm']:.3f}")
    parts.append(f" number of skipped iterations: {metrics['skipped']:3d}")
    parts.append(f" number of nan iterations: {metrics['nan']:3d}")
    if metrics.get("eta_s") is not None:
        parts.append(f" ETA: {format_eta(metrics['eta_s'])}")
    return " |".join(parts) + " |"


def validation_line(label: str, where: str, loss: float) -> str:
    """Megatron's evaluation line; where is "iteration N" or "the end of training for val data"."""
    ppl = math.exp(min(20.0, loss))
    return f" {label} loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "


class MetricsJSONL:
    """The iteration and evaluation lines as JSON objects, one per line, appended to `path` (a
    resumed run continues the file). path None writes nothing."""

    def __init__(self, path: str | None):
        self.file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")  # kept open for the whole run

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class ScalarWriters:
    """TensorBoard and/or wandb, created only when their flags ask (their packages are the entry
    point's start-up checks: megafab.run.packages).

    cfg None makes a writer that writes nothing (ranks other than the logging rank). wandb runs as
    the environment's WANDB_MODE says (online by default, as wandb's own default).
    """

    def __init__(self, cfg, config_dict: dict):
        self.tb = None
        self.wandb = None
        if cfg is None:  # ranks that do not log
            return
        lg = cfg.logging
        if lg.tensorboard_dir:
            import_optional("tensorboard", "--tensorboard-dir")
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=lg.tensorboard_dir, max_queue=lg.tensorboard_queue_size)
        if lg.wandb_project:
            wandb = import_optional("wandb", "--wandb-project")
            save_dir = lg.wandb_save_dir or os.path.join(cfg.checkpoint.save or ".", "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name or None,
                                    entity=lg.wandb_entity or None, dir=save_dir, config=config_dict)

    def scalars(self, iteration: int, values: dict, consumed_samples: int | None = None,
                wandb: bool = True) -> None:
        """Each value under its tag at step `iteration`, and (Megatron's twin) under
        "<tag> vs samples" at step consumed_samples when given."""
        values = {k: v for k, v in values.items() if v is not None}
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, iteration)
                if consumed_samples is not None:
                    self.tb.add_scalar(f"{key} vs samples", value, consumed_samples)
        if self.wandb is not None and wandb and values:
            self.wandb.log(values, step=iteration)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
