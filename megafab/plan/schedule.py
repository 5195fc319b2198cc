"""How a pipeline schedule turns each stage's per-micro-batch times into the time of all micro-batches.

With p stages, m micro-batches and v model chunks per stage (v = 1: 1F1B; v > 1: interleaved 1F1B,
Megatron's schedules), stage i spending T_i = forward + backward on one micro-batch (all its chunks):

    steady state  m x max_i T_i              the slowest stage sets the pace
    fill + drain  (sum_i T_i - max_i T_i) / v
                  = (p - 1) T / v for equal stages: the bubble, (p-1)/m of the ideal with 1F1B and
                  (p-1)/(v m) interleaved (Narayanan et al. 2021, sec. 2.2)

Point-to-point transfers between stages: megafab's schedules wait for each one (no overlapped p2p):
a forward and a backward transfer per micro-batch and model chunk, plus the fill, so the
interleaved schedule's smaller bubble costs v times the transfers
(megafab.distributed.pipeline_interleaved).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineTime:
    compute: float  # m x the ideal per-micro-batch time of the slowest stage
    bubble: float  # fill and drain
    p2p: float  # exposed send/recv

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.p2p


def pipeline_time(stage_seconds: list[float], micro_batches: int, vpp: int,
                  p2p_seconds: float) -> PipelineTime:
    """stage_seconds[i]: forward + backward of one micro-batch on stage i; p2p_seconds: one transfer."""
    pp = len(stage_seconds)
    slowest = max(stage_seconds)
    compute = micro_batches * slowest
    bubble = (sum(stage_seconds) - slowest) / vpp
    if pp == 1:
        return PipelineTime(compute, 0.0, 0.0)
    transfers = 2 * (vpp * micro_batches + pp - 1)
    return PipelineTime(compute, bubble, transfers * p2p_seconds)
