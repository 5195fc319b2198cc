"""The step-time model against measured steps on this machine: every valid layout of a small GPT at
world 2 and 4 (gloo, one thread per rank) runs a few timed iterations and is predicted from a
machine profile measured here (megafab-estimate --profile).

    megafab-estimate --profile here.json
    python benchmarks/layout_search.py --machine here.json [--worlds 2 4 --iters 4 --rounds 1
                                        --layers 4 --hidden 128 --heads 4 --seq 64 --vocab 1024 --batch 8]

Layouts: every (TP, PP, VPP, DP, SP, micro-batch, recompute, sharding) the config accepts
(megafab.plan.search.every_valid_layout; --micro-batches, --recompute and --sharding narrow it).
Each run: build the model and optimizer as pretrain does (megafab's build_state), one warm-up step,
then `--iters` timed train_steps; the slowest rank's median step (the ranks meet in every step's
collectives, so one step is timed alike on each; the median keeps a step another process
preempted on a shared machine out). Rounds are interleaved (every
layout once per round); a layout's time is its median over rounds.

Printed per world: each layout's predicted and measured seconds and their ratio, then the median
|predicted/measured - 1|, the Spearman rank correlation, and the measured time of the predicted-best
layout relative to the measured best. Issue 25 asks <= 15%, >= 0.8 and within 10%.
Each round starts by re-launching the profile's calibration layouts of the world once
(megafab.calibrate.steps.speed_drift) and prints their steps over the profile's: a shared VM's speed
moves by up to 2x over minutes, and that drift, not the model, then decides the error. The
drift-corrected error (each round's times over its drift) is printed apart, as a diagnostic.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_util import (  # noqa: E402
    build_state,
    gpt_flags,
    load_average,
    model_size_args,
    repeat_batch,
    synthetic_batch,
)
from megafab.calibrate.steps import speed_drift  # noqa: E402
from megafab.plan.machines import Machine  # noqa: E402
from megafab.plan.planner import plan  # noqa: E402
from megafab.plan.search import every_valid_layout  # noqa: E402
from megafab.plan.step_time import predict  # noqa: E402
from megafab.run.fork_ranks import run_ranks  # noqa: E402
from megafab.training.step import train_step  # noqa: E402


def _step_seconds(rank, world, flags, mbs, args):
    torch.set_num_threads(1)
    state = build_state(flags, world_size=world)
    data = repeat_batch(synthetic_batch(mbs, args.seq, args.vocab))
    train_step(state, data)
    dist.barrier()
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        train_step(state, data)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def describe(cfg) -> str:
    p, m = cfg.parallel, cfg.model
    sharding = "fsdp2" if p.fully_sharded else "distopt" if p.use_distributed_optimizer else "ddp"
    vpp = p.virtual_pipeline_model_parallel_size
    return (f"TP{p.tensor_model_parallel_size} PP{p.pipeline_model_parallel_size}"
            f"{f' VPP{vpp}' if vpp else ''}"
            f" DP{p.data_parallel_size}{' SP' if p.sequence_parallel else ''}"
            f" mbs{cfg.training.micro_batch_size} {m.recompute_granularity or 'none'} {sharding}")


def run_world(args, machine, world: int) -> None:
    flags = gpt_flags(args.layers, args.hidden, args.heads, args.seq, 1, args.vocab)
    flags[flags.index("--global-batch-size") + 1] = str(args.batch)
    layouts = every_valid_layout(flags, world, micro_batch_sizes=args.micro_batches,
                                 recomputes=args.recompute, shardings=args.sharding)
    predicted = [predict(cfg, machine, plan(cfg, "cpu")).step_time_s for _, cfg in layouts]
    measured: list[list[float]] = [[] for _ in layouts]
    drifts = []
    for _ in range(args.rounds):
        if machine.calibration_steps:
            drifts.append(speed_drift(machine, world, timeout=args.timeout))
        for i, (f, cfg) in enumerate(layouts):
            seconds = run_ranks(_step_seconds, world, f, cfg.training.micro_batch_size, args,
                                timeout=args.timeout)
            measured[i].append(max(seconds))
    medians = [statistics.median(m) for m in measured]
    print(f"\nworld {world}: {len(layouts)} layouts, {args.iters} timed iterations, {args.rounds} round(s); "
          f"{load_average()}")
    if drifts and None not in drifts:
        print("the profile's calibration steps at each round's start, over their time at the profile: "
              + " ".join(f"{d:.2f}x" for d in drifts))
    print(f"{'layout':<44} {'predicted s':>12} {'measured s':>12} {'pred/meas':>10}")
    for (_, cfg), p, m in sorted(zip(layouts, predicted, medians), key=lambda r: r[2]):
        print(f"{describe(cfg):<44} {p:12.4f} {m:12.4f} {p / m:10.2f}")
    errors = [abs(p / m - 1) for p, m in zip(predicted, medians)]
    best_predicted = min(range(len(layouts)), key=predicted.__getitem__)
    print(f"median |predicted/measured - 1| = {statistics.median(errors):.1%}; Spearman = "
          f"{spearman(predicted, medians):.2f}; predicted-best ({describe(layouts[best_predicted][1])}) "
          f"measured {medians[best_predicted] / min(medians):.2f}x the measured best")
    if drifts and None not in drifts:
        steady = [statistics.median(t / d for t, d in zip(m, drifts)) for m in measured]
        print(f"(the machine's drift taken out, each round's times over its drift: median error "
              f"{statistics.median(abs(p / m - 1) for p, m in zip(predicted, steady)):.1%}, Spearman "
              f"{spearman(predicted, steady):.2f}; a diagnostic, not the acceptance numbers above)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_size_args(ap, layers=4, hidden=128, heads=4, seq=64, vocab=1024)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--machine", required=True, help="profile from megafab-estimate --profile")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--recompute", nargs="+", default=["none", "selective", "full"])
    ap.add_argument("--sharding", nargs="+", default=["none", "distributed_optimizer", "fsdp2"])
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args(argv)
    machine = Machine.load(args.machine)
    for world in args.worlds:
        run_world(args, machine, world)


if __name__ == "__main__":
    main()
