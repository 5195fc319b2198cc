"""How a pipeline schedule turns each stage's per-micro-batch times into the time of all micro-batches.

With p stages, m micro-batches and v model chunks per stage (v = 1: 1F1B; v > 1: interleaved 1F1B),
stage i spending T_i = forward + backward on one micro-batch (all its chunks):
    steady state  m x max_i T_i              the slowest stage sets the pace
    fill + drain  (sum_i T_i - max_i T_i) / v, the bubble: (p-1)/m of the ideal with 1F1B and
                  (p-1)/(v m) interleaved for equal stages (Narayanan et al. 2021, sec. 2.2)
megafab's schedules wait for every point-to-point transfer: one each way per micro-batch and model
chunk, plus the fill, so interleaving's smaller bubble costs v times the transfers.

Ranks sharing a CPU's cores compute in turn only while they are busy: in the fill and drain most
stages wait and leave their cores to the others. shared_pipeline_time runs the order the executors
run (megafab.distributed.schedule_table) through time, each running pass's compute stretched by the
machine's sharing at the number of ranks computing then (collectives are measured, not stretched).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megafab.distributed.schedule_table import schedule_table, upstream


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
    return PipelineTime(compute, bubble, _transfers(pp, micro_batches, vpp) * p2p_seconds)


def _transfers(pp: int, micro_batches: int, vpp: int) -> int:
    """Waited send/recvs per step: one each way per micro-batch and chunk, plus the fill."""
    return 2 * (vpp * micro_batches + pp - 1)


@dataclass(frozen=True)
class StagePass:
    """One micro-batch's forward or backward through a stage's model chunks, apart: the part that
    shares the cores with the other ranks (kernels, host work) and the part that does not."""
    compute: float
    comm: float


def shared_pipeline_time(forward: list[StagePass], backward: list[StagePass], micro_batches: int,
                         vpp: int, p2p_seconds: float, slowdown: Callable[[int], float],
                         group_size: int | None = None) -> PipelineTime:
    """pipeline_time for ranks that share compute: forward[i] / backward[i] are stage i's passes of
    one micro-batch (all its chunks; each chunk does 1/vpp), slowdown(k) how much longer compute
    takes while k stages compute. Runs every stage's schedule_table through time; the compute part
    is m x the slowest stage at the full slowdown where the run is no shorter, the bubble the rest."""
    pp = len(forward)
    orders = [schedule_table(s, pp, micro_batches, vpp, group_size) for s in range(pp)]
    done: set = set()  # (stage, forward?, micro-batch, chunk) of every pass finished
    position = [0] * pp
    left: dict[int, float] = {}  # running stage -> fraction of its pass still to run
    clock = 0.0
    while any(position[s] < len(orders[s]) for s in range(pp)):
        for s in range(pp):
            if s not in left and position[s] < len(orders[s]):
                needs = upstream(s, orders[s][position[s]], pp, vpp)
                if needs is None or needs in done:
                    left[s] = 1.0
        assert left, "the schedule waits on itself"  # its order and upstream disagree
        k = slowdown(len(left))
        passes = {s: (forward if orders[s][position[s]].forward else backward)[s] for s in left}
        seconds = {s: (p.compute * k + p.comm) / vpp for s, p in passes.items()}
        step = min(left[s] * seconds[s] for s in left)
        clock += step
        for s in list(left):
            left[s] -= step / seconds[s] if seconds[s] else left[s]
            if left[s] <= 1e-9:
                p = orders[s][position[s]]
                done.add((s, p.forward, p.microbatch, p.chunk))
                position[s] += 1
                del left[s]
    full = slowdown(pp)
    compute = min(clock, micro_batches * max(f.compute * full + f.comm + b.compute * full + b.comm
                                             for f, b in zip(forward, backward)))
    return PipelineTime(compute, clock - compute, _transfers(pp, micro_batches, vpp) * p2p_seconds)
