"""The log lines Megatron users already parse, and optional TensorBoard / wandb writers."""

from __future__ import annotations

import math
import os
import time


def timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def iteration_line(iteration: int, train_iters: int, metrics: dict) -> str:
    """` [time] iteration N/ T | consumed samples: ... | ... |` in Megatron's order and format."""
    parts = [f" [{timestamp()}] iteration {iteration:8d}/{train_iters:8d}",
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
    parts.append(f" loss scale: {metrics['loss_scale']:.1f}")
    if metrics.get("grad_norm") is not None:
        parts.append(f" grad norm: {metrics['grad_norm']:.3f}")
    if metrics.get("num_zeros") is not None:
        parts.append(f" num zeros: {metrics['num_zeros']:.1f}")
    parts.append(f" number of skipped iterations: {metrics['skipped']:3d}")
    parts.append(f" number of nan iterations: {metrics['nan']:3d}")
    return " |".join(parts) + " |"


def validation_line(label: str, where: str, loss: float) -> str:
    """Megatron's evaluation line; where is "iteration N" or "the end of training for val data"."""
    ppl = math.exp(min(20.0, loss))
    return f" {label} loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "


class ScalarWriters:
    """TensorBoard and/or wandb, created only when their flags ask (clear error if not installed).

    cfg None makes a writer that writes nothing (ranks other than the logging rank).
    """

    def __init__(self, cfg, config_dict: dict):
        self.tb = None
        self.wandb = None
        self.interval = 1
        if cfg is None:  # ranks that do not log
            return
        lg = cfg.logging
        self.interval = lg.tensorboard_log_interval
        if lg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise SystemExit("megafab: error: --tensorboard-dir needs the tensorboard package: "
                                 "pip install tensorboard") from err
            self.tb = SummaryWriter(log_dir=lg.tensorboard_dir, max_queue=1000)
        if lg.wandb_project:
            try:
                import wandb
            except ImportError as err:
                raise SystemExit("megafab: error: --wandb-project needs the wandb package: "
                                 "pip install megafab[wandb]") from err
            os.environ.setdefault("WANDB_MODE", "offline")
            save_dir = lg.wandb_save_dir or os.path.join(cfg.checkpoint.save or ".", "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name or None,
                                    dir=save_dir, config=config_dict)

    def scalars(self, iteration: int, values: dict) -> None:
        values = {k: v for k, v in values.items() if v is not None}
        if self.tb is not None and iteration % self.interval == 0:
            for key, value in values.items():
                self.tb.add_scalar(key, value, iteration)
        if self.wandb is not None:
            self.wandb.log(values, step=iteration)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
