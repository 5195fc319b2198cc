"""The global batch size of each step: constant, ramped up by --rampup-batch-size, or stepped by
--step-batch-size-schedule (megafab/config/batch_schedule.py, Megatron-LM HEAD's).

Megatron's RampupBatchsizeNumMicroBatchesCalculator: with START INCREMENT SAMPLES and final batch
G there are (G - START) / INCREMENT increments, one every SAMPLES / increments consumed samples:

    batch(consumed) = G                                                  if consumed > SAMPLES
                    = START + floor(consumed / (SAMPLES / increments)) * INCREMENT   otherwise

Each step consumes (and the LR schedule advances by) the batch it ran, so a ramp is counted in
samples actually consumed, and a resumed run continues the ramp from its consumed samples.
"""

from __future__ import annotations

from megafab.config import ConfigError
from megafab.config.batch_schedule import batch_at, iterations_for, parse_step_schedule


def _schedule(cfg):
    t = cfg.training
    if t.step_batch_size_schedule is None:
        return None
    return parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)


def global_batch_size_at(cfg, consumed_samples: int) -> int:
    t = cfg.training
    schedule = _schedule(cfg)
    if schedule is not None:
        return batch_at(schedule, consumed_samples)
    if t.rampup_batch_size is None:
        return t.global_batch_size
    start, increment, ramp_samples = t.rampup_batch_size
    increments = (t.global_batch_size - start) // increment
    if consumed_samples > ramp_samples or increments == 0:
        return t.global_batch_size
    return start + int(consumed_samples / (ramp_samples / increments)) * increment


def num_micro_batches_at(cfg, consumed_samples: int) -> int:
    t, p = cfg.training, cfg.parallel
    return global_batch_size_at(cfg, consumed_samples) // (t.micro_batch_size * p.data_parallel_size)


def batch_problem_at(cfg, consumed_samples: int) -> ConfigError | None:
    """A resumed run's batch that the layout cannot split (Megatron's consistency check): the start-up
    rules pass a schedule's leading batches when --load may have consumed past them."""
    t, p = cfg.training, cfg.parallel
    step = t.micro_batch_size * p.data_parallel_size
    batch = global_batch_size_at(cfg, consumed_samples)
    if batch % step == 0:
        return None
    return ConfigError([f"--step-batch-size-schedule {t.step_batch_size_schedule!r}: at {consumed_samples} "
                        f"consumed samples the global batch is {batch}, not divisible by --micro-batch-size "
                        f"x data-parallel size = {step}; resume with a data-parallel size that divides it"])


def train_iterations(cfg) -> int:
    """Steps to train: --train-iters, or the steps --train-samples lasts (Megatron's
    update_train_iters): whole batches at a constant size; with a ramp, the ramp's steps (while
    consumed <= SAMPLES), then whole final-size batches (a partial last batch is dropped); with a
    step schedule, the steps while consumed < --train-samples."""
    t = cfg.training
    if t.train_iters is not None:
        return t.train_iters
    samples = t.train_samples or 0
    schedule = _schedule(cfg)
    if schedule is not None:
        return iterations_for(schedule, samples)
    if t.rampup_batch_size is None:
        return samples // t.global_batch_size  # Megatron's: a partial last batch is not trained
    iterations = consumed = 0
    while consumed <= t.rampup_batch_size[2] and consumed <= samples:
        consumed += global_batch_size_at(cfg, consumed)
        iterations += 1
    if samples > consumed:
        iterations += (samples - consumed) // t.global_batch_size
    return iterations
