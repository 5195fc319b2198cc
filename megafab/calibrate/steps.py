"""Collective latency as a training step sees it, on a CPU: megafab's own train_step at world 2 and 4.

The profile's collective loop (collectives.measure_collectives) times calls between GEMMs; inside a
step the ranks also run autograd, the schedule and gloo's worker threads on the same cores, and
that loop's per-call cost was off by 2-3x either way from one machine to the next. So a CPU
profile also launches a tiny GPT (CALIBRATION_FLAGS) under one layout per collective it prices
(CALIBRATION_LAYOUTS: TP without SP for all-reduce, TP with SP for all-gather and reduce-scatter,
PP for send/recv, each at the group sizes a world of 2 or 4 has), times its steps as the layout
benchmark does (each rank's median step, the slowest rank's), and fits that collective's alpha so
the step-time model, with everything else it knows (kernels, host overheads, the schedule), gives
the measured step. The fit goes into the profile's collectives as "n@world" (a group of n in a job
of `world` ranks sharing the cores), beside the loop's "n" entry, whose bus bandwidth it keeps:
the calibration's messages are a few KiB, alpha-bound.
"""

from __future__ import annotations

import statistics
import time

import torch.distributed as dist

from megafab.arguments import config_from_args
from megafab.calibrate.host import host_batches, host_flags
from megafab.plan.host_terms import FSDP_SUFFIX, STEP_SUFFIX, measured_key
from megafab.plan.planner import plan
from megafab.plan.step_time import predict
from megafab.run.fork_ranks import run_ranks
from megafab.training.build import init_distributed
from megafab.training.pretrain import setup
from megafab.training.step import train_step

CALIBRATION_FLAGS = host_flags(2, 4, heads=4)  # the host-overhead GPT, with heads for TP 4
_TP = "--tensor-model-parallel-size"
_PP = "--pipeline-model-parallel-size"
_DIST_OPT = "--use-distributed-optimizer"
_FSDP2 = "--use-torch-fsdp2"
_GATHERS = ("all_gather", "reduce_scatter")

# (world, group size, the ops whose alpha the layout fits, which alpha, the layout's flags).
# "alpha": the per-layer collectives' ("n@world"; TP, SP, PP's send/recv),
# "step_alpha": the data-parallel reductions' issued once a step after the backward
# ("n@world:step"): there the ranks arrive as unevenly as their whole backward ran, and the wait,
# not the bytes, is the cost (a model 4x larger measured the same extra time per step here);
# "fsdp_alpha": FSDP2's per-group gathers and reduce-scatters ("n@world:fsdp"): torch's FSDP2 skips
# its collectives' host work on a group of one (so the world-1 host rows do not see it), and priced
# as TP's every FSDP2 layout over DP 2 measured 0.6-0.76x its prediction here. Each
# layout's other collectives are priced by the other rows' current fits (FIT_SWEEPS sweeps: a
# group of 2 at world 4 never runs alone, TP 2 comes with PP 2 or DP 2). PP's send/recv at world 4
# keeps the loop's "2": fitted from PP 2 x DP 2 it traded off against DP's step alpha.
CALIBRATION_LAYOUTS = [
    (2, 2, ("all_reduce",), "alpha", [_TP, "2"]),
    (2, 2, _GATHERS, "alpha", [_TP, "2", "--sequence-parallel"]),
    (2, 2, ("all_reduce",), "step_alpha", []),
    (2, 2, _GATHERS, "step_alpha", [_DIST_OPT]),
    (2, 2, ("send_recv",), "alpha", [_PP, "2"]),
    (2, 2, _GATHERS, "fsdp_alpha", [_FSDP2]),
    (4, 4, ("all_reduce",), "alpha", [_TP, "4"]),
    (4, 4, _GATHERS, "alpha", [_TP, "4", "--sequence-parallel"]),
    (4, 4, ("all_reduce",), "step_alpha", []),
    (4, 4, _GATHERS, "step_alpha", [_DIST_OPT]),
    (4, 2, ("all_reduce",), "alpha", [_TP, "2", _PP, "2"]),
    (4, 2, _GATHERS, "alpha", [_TP, "2", _PP, "2", "--sequence-parallel"]),
    (4, 2, ("all_reduce",), "step_alpha", [_TP, "2"]),
    (4, 2, _GATHERS, "step_alpha", [_TP, "2", _DIST_OPT]),
    (4, 4, _GATHERS, "fsdp_alpha", [_FSDP2]),
    (4, 2, _GATHERS, "fsdp_alpha", [_TP, "2", _FSDP2]),
]
TERM_SUFFIX = {"alpha": "", "step_alpha": STEP_SUFFIX, "fsdp_alpha": FSDP_SUFFIX}
FIT_SWEEPS = 6
WARMUP_STEPS, TIMED_STEPS = 2, 7
# Each row's step is the median of its launches, the rows launched in turn round after round: on a
# shared VM a burst of other work slows every step for seconds, i.e. one launch (a row measured
# once then fitted an alpha 5x too large here, and every layout was priced with it).
ROUNDS = 3
MAX_ALPHA_S = 0.1


def _median_step(rank: int, world: int, flags: list[str]) -> float:
    """In a forked rank: the layout's model built as pretrain does, then its median train_step."""
    cfg = config_from_args(flags, world_size=world)
    topo, tracker = init_distributed(cfg)
    state = setup(cfg, topo, tracker)
    data = host_batches()
    for _ in range(WARMUP_STEPS):
        train_step(state, data)
    dist.barrier()
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        train_step(state, data)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_calibration_steps(worlds: list[int], timeout: float = 60.0) -> list[dict]:
    """Each CALIBRATION_LAYOUTS row of the given worlds with its measured step: the median over
    ROUNDS launches of the slowest rank's median step."""
    return _measured_rows([row for row in CALIBRATION_LAYOUTS if row[0] in worlds], ROUNDS, timeout)


def _measured_rows(layouts: list[tuple], rounds: int, timeout: float) -> list[dict]:
    launches: list[list[float]] = [[] for _ in layouts]
    for _ in range(rounds):
        for (world, _, _, _, extra), steps in zip(layouts, launches):
            steps.append(max(run_ranks(_median_step, world, CALIBRATION_FLAGS + extra, timeout=timeout)))
    return [{"world": world, "group": group, "ops": list(ops), "term": term, "flags": extra,
             "step_s": statistics.median(steps)}
            for (world, group, ops, term, extra), steps in zip(layouts, launches)]


def _predicted(machine, cfg, stages) -> float:
    return predict(cfg, machine, stages).step_time_s


def _set_term(machine, row: dict, alpha: float) -> None:
    """The row's ops' "group@world" entry (with its term's TERM_SUFFIX) with alpha set, its bus
    bandwidth the loop's."""
    key = measured_key(row["group"], row["world"], TERM_SUFFIX[row["term"]])
    for op in row["ops"]:
        table = machine.collectives.setdefault(op, {})
        loop = table.get(str(row["group"]))
        table[key] = [alpha, loop[1] if loop else 1e9]


def fit_step_collectives(rows: list[dict], machine) -> None:
    """Into machine.collectives: each row's alpha, solved by bisection (the step time grows with it)
    so the model predicts the row's measured step, in FIT_SWEEPS sweeps over the rows (each solved
    with the others' latest); 0 where the model without the row's collectives is already slower
    than the step."""
    built = []
    for row in rows:
        cfg = config_from_args(CALIBRATION_FLAGS + row["flags"], world_size=row["world"])
        built.append((row, cfg, plan(cfg, "cpu")))
    for _ in range(FIT_SWEEPS):
        for row, cfg, stages in built:
            _fit_row(machine, row, cfg, stages)


def _fit_row(machine, row: dict, cfg, stages) -> None:
    """The row's alpha with every other entry as it stands."""
    lo, hi = 0.0, MAX_ALPHA_S
    _set_term(machine, row, hi)
    if _predicted(machine, cfg, stages) < row["step_s"]:
        return  # slower than any alpha explains: keep the largest
    for _ in range(40):
        mid = (lo + hi) / 2
        _set_term(machine, row, mid)
        if _predicted(machine, cfg, stages) < row["step_s"]:
            lo = mid
        else:
            hi = mid
    _set_term(machine, row, lo)


def speed_drift(machine, world: int, timeout: float = 60.0) -> float | None:
    """How much slower the profile's calibration layouts of this world step now than when the
    profile measured them (one launch each; the median ratio); None for a profile without them."""
    then = [row for row in machine.calibration_steps if row["world"] == world and row["step_s"] > 0]
    if not then:
        return None
    layouts = [(r["world"], r["group"], tuple(r["ops"]), r["term"], r["flags"]) for r in then]
    now = _measured_rows(layouts, 1, timeout)
    return statistics.median(n["step_s"] / t["step_s"] for n, t in zip(now, then))
