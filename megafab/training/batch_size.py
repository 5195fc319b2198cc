"""The global batch size of each step: constant, or ramped up by --rampup-batch-size.

Megatron's RampupBatchsizeNumMicroBatchesCalculator: with START INCREMENT SAMPLES and final batch
G there are (G - START) / INCREMENT increments, one every SAMPLES / increments consumed samples:

    batch(consumed) = G                                                  if consumed > SAMPLES
                    = START + floor(consumed / (SAMPLES / increments)) * INCREMENT   otherwise

Each step consumes (and the LR schedule advances by) the batch it ran, so the ramp is counted in
samples actually consumed, and a resumed run continues the ramp from its consumed samples.
"""

from __future__ import annotations


def global_batch_size_at(cfg, consumed_samples: int) -> int:
    t = cfg.training
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


def train_iterations(cfg) -> int:
    """Steps to train: --train-iters, or the steps --train-samples lasts. With a ramp, Megatron's
    count: the ramp's steps (while consumed <= SAMPLES), then whole final-size batches (a partial
    last batch is dropped)."""
    t = cfg.training
    if t.train_iters is not None:
        return t.train_iters
    samples = t.train_samples or 0
    if t.rampup_batch_size is None:
        return -(-samples // t.global_batch_size)
    iterations = consumed = 0
    while consumed <= t.rampup_batch_size[2] and consumed <= samples:
        consumed += global_batch_size_at(cfg, consumed)
        iterations += 1
    if samples > consumed:
        iterations += (samples - consumed) // t.global_batch_size
    return iterations
