"""The MoE balancing losses in the training log, as Megatron's training_log + track_moe_metrics:
after the lm loss in the iteration line, averaged over the iterations since the last line (its
total_loss_dict), and to TensorBoard every iteration under their own names."""

from __future__ import annotations

import types

import torch

from megafab.training.log_line import iteration_line
from megafab.training.train_log import TrainingLog
from tests.model.tiny import tiny_config


class _Writers:
    def __init__(self):
        self.calls = []

    def scalars(self, iteration, values, consumed_samples=None, wandb=True):
        self.calls.append((iteration, dict(values)))

    def close(self):
        pass


def test_balancing_losses_follow_the_lm_loss_in_megatrons_format():
    metrics = dict(consumed_samples=8, elapsed_ms=10.0, tokens_per_sec=1.0, lr=1e-3, global_batch_size=4,
                   loss_scale=1.0, skipped=0, nan=0, **{"lm loss": 4.5})
    line = iteration_line(2, 5, metrics, "t", losses={"load_balancing_loss": 1.25, "z_loss": 0.5})
    assert " lm loss: 4.500000E+00 | load_balancing_loss: 1.250000E+00 | z_loss: 5.000000E-01 |" \
           " loss scale: 1.0 |" in line


def test_line_averages_over_the_log_interval_and_tensorboard_gets_every_iteration(capsys):
    cfg = tiny_config(log_interval=2, tensorboard_log_interval=1000)
    topo = types.SimpleNamespace(rank=0, world_size=1, dp_rank=0, device=torch.device("cpu"))
    log = TrainingLog(cfg, topo, 0)
    log.writers = _Writers()
    optimizer = types.SimpleNamespace(grad_scaler=None)
    state = types.SimpleNamespace(iteration=0, consumed_train_samples=0, skipped_iterations=0,
                                  nan_iterations=0, optimizer=optimizer,
                                  scheduler=types.SimpleNamespace(get_lr=lambda: 1e-3))
    for value in (1.0, 2.0):
        state.iteration += 1
        state.consumed_train_samples += 4
        log.after_step(state, {"lm loss": 4.0, "grad_norm": 1.0, "num_zeros": None, "global_batch_size": 4,
                               "moe_losses": {"load_balancing_loss": value}})
    moe_scalars = [(it, v) for it, v in log.writers.calls if "load_balancing_loss" in v]
    assert moe_scalars == [(1, {"load_balancing_loss": 1.0}), (2, {"load_balancing_loss": 2.0})]
    assert "load_balancing_loss: 1.500000E+00 |" in capsys.readouterr().out
    assert log.window_moe == {}  # the next line averages its own iterations
