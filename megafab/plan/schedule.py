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

Ranks sharing a CPU's cores (a CPU profile: more ranks than cores) compute in turn only while they
are busy: in the fill and drain most stages wait, and the waiting ranks leave their cores to the
others. shared_pipeline_time runs the schedule's own order (megafab.distributed.pipeline and
pipeline_interleaved) through time, each running pass's compute stretched by the machine's sharing
at the number of ranks computing then (its collectives are measured in-step and not stretched).
"""

from __future__ import annotations

from collections.abc import Callable
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


def schedule_order(stage: int, pp: int, micro_batches: int, vpp: int) -> list[tuple[bool, int, int]]:
    """(forward?, micro-batch, chunk) in the order megafab's schedule runs them on `stage`: 1F1B's
    p-s-1 warm-up forwards, or the interleaved schedule's, then one forward one backward, then the
    cool-down backwards."""
    total = micro_batches * vpp
    if vpp == 1:
        warmup = min(pp - stage - 1, micro_batches)
    else:
        warmup = total if micro_batches == pp else min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)

    def at(k: int, forward: bool) -> tuple[bool, int, int]:
        chunk = (k % (pp * vpp)) // pp
        return forward, (k // (pp * vpp)) * pp + k % pp, chunk if forward else vpp - 1 - chunk

    order = [at(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        order += [at(warmup + i, True), at(i, False)]
    return order + [at(k, False) for k in range(total - warmup, total)]


def _waits_on(stage: int, task: tuple[bool, int, int], pp: int, vpp: int) -> tuple | None:
    """The (stage, task) whose output `task` needs: the previous stage's forward (chunk c - 1 of the
    last stage for the first), the next stage's backward (chunk c + 1 of the first for the last);
    the loss's backward needs only this stage's own forward, which comes before it."""
    forward, mb, chunk = task
    if forward:
        if stage > 0:
            return stage - 1, (True, mb, chunk)
        return (pp - 1, (True, mb, chunk - 1)) if chunk > 0 else None
    if stage < pp - 1:
        return stage + 1, (False, mb, chunk)
    return (0, (False, mb, chunk + 1)) if chunk < vpp - 1 else None


def shared_pipeline_time(forward: list[StagePass], backward: list[StagePass], micro_batches: int,
                         vpp: int, p2p_seconds: float, slowdown: Callable[[int], float]) -> PipelineTime:
    """pipeline_time for ranks that share compute: forward[i] / backward[i] are stage i's passes of
    one micro-batch (all its chunks; each chunk does 1/vpp), slowdown(k) how much longer compute
    takes while k stages compute. Runs every stage's schedule_order through time; the compute part
    is m x the slowest stage at the full slowdown where the run is no shorter, the bubble the rest."""
    pp = len(forward)
    orders = [schedule_order(s, pp, micro_batches, vpp) for s in range(pp)]
    done: set = set()
    position = [0] * pp
    left: dict[int, float] = {}  # running stage -> fraction of its pass still to run
    clock = 0.0
    while any(position[s] < len(orders[s]) for s in range(pp)):
        for s in range(pp):
            if s not in left and position[s] < len(orders[s]):
                needs = _waits_on(s, orders[s][position[s]], pp, vpp)
                if needs is None or needs in done:
                    left[s] = 1.0
        assert left, "the schedule waits on itself"  # its order and _waits_on disagree
        k = slowdown(len(left))
        passes = {s: (forward if orders[s][position[s]][0] else backward)[s] for s in left}
        seconds = {s: (p.compute * k + p.comm) / vpp for s, p in passes.items()}
        step = min(left[s] * seconds[s] for s in left)
        clock += step
        for s in list(left):
            left[s] -= step / seconds[s] if seconds[s] else left[s]
            if left[s] <= 1e-9:
                done.add((s, orders[s][position[s]]))
                position[s] += 1
                del left[s]
    full = slowdown(pp)
    compute = min(clock, micro_batches * max(f.compute * full + f.comm + b.compute * full + b.comm
                                             for f, b in zip(forward, backward)))
    return PipelineTime(compute, clock - compute, _transfers(pp, micro_batches, vpp) * p2p_seconds)
