"""The MoE balancing losses in the training log, as Megatron's training_log + track_moe_metrics:
after the lm loss in the iteration line, averaged over the iterations since the last line (its
total_loss_dict), and to TensorBoard every iteration under their own names."""

from __future__ import annotations

import types

import torch

from megafab.training.log_line import iteration_line
from megafab.training.train_log import TrainingLog
from tests.helpers.tiny import tiny_config


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
        log.after_step(state, {"lm loss": 3.0 + value, "grad_norm": 1.0, "num_zeros": None,
                               "global_batch_size": 4, "update_ok": True,
                               "moe_losses": {"load_balancing_loss": value}})
    moe_scalars = [(it, v) for it, v in log.writers.calls if "load_balancing_loss" in v]
    assert moe_scalars == [(1, {"load_balancing_loss": 1.0}), (2, {"load_balancing_loss": 2.0})]
    first, second = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    # the run's first iteration is printed (Megatron 0.16) without closing the window
    assert "iteration        1/" in first and "lm loss: 4.000000E+00 |" in first
    assert "load_balancing_loss: 1.000000E+00 |" in first
    assert "lm loss: 4.500000E+00 |" in second and "load_balancing_loss: 1.500000E+00 |" in second
    assert log.window_moe == {}  # the next line averages its own iterations


def test_lm_loss_and_skip_counts_are_the_windows_as_megatrons_total_loss_dict(capsys):
    cfg = tiny_config(log_interval=3, tensorboard_log_interval=1000)
    topo = types.SimpleNamespace(rank=0, world_size=1, dp_rank=0, device=torch.device("cpu"))
    log = TrainingLog(cfg, topo, 0)
    log.writers = _Writers()
    state = types.SimpleNamespace(iteration=0, consumed_train_samples=0, skipped_iterations=0,
                                  nan_iterations=0, optimizer=types.SimpleNamespace(grad_scaler=None),
                                  scheduler=types.SimpleNamespace(get_lr=lambda: 1e-3))
    # window 1: iterations 1-3, the second skipped (non-finite grads); window 2: 4-6, all applied
    steps = [(2.0, 1.0, True), (9.0, float("inf"), False), (4.0, 1.0, True),
             (1.0, 1.0, True), (2.0, 1.0, True), (3.0, 1.0, True)]
    for loss, grad_norm, ok in steps:
        state.iteration += 1
        log.after_step(state, {"lm loss": loss, "grad_norm": grad_norm, "num_zeros": None,
                               "global_batch_size": 4, "update_ok": ok})
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert [int(line.split("iteration")[1].split("/")[0]) for line in lines] == [1, 3, 6]
    assert "lm loss: 3.000000E+00 |" in lines[1]  # (2 + 4) / 2: the skipped iteration left out
    assert "number of skipped iterations:   1 |" in lines[1] and "number of nan iterations:   1 |" in lines[1]
    assert "lm loss: 2.000000E+00 |" in lines[2]
    assert "number of skipped iterations:   0 |" in lines[2] and "number of nan iterations:   0 |" in lines[2]
