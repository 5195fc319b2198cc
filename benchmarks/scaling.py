"""Scaling on this machine: TP 2, DP 2 and PP 2 (two gloo processes, one thread each) against one
process with two threads, same model and global batch.

    python benchmarks/scaling.py [--layers 4 --hidden 512 --heads 8 --seq 256 --batch 8 --vocab 8192
                                  --steps 2 --rounds 3]

Every run goes through megafab's build_model / build_optimizer / train_step (fp32, one fixed
synthetic batch per micro-batch). Each layout is compared with a one-process run of the same global
batch and the same micro-batch size (so DP 2 is compared with 2 accumulated micro-batches of b/2,
PP 2 with m = 4 micro-batches of b/4):

    efficiency = (1 process, 2 threads step time) / (2 processes x 1 thread step time)

1.0 means the two processes use the two cores as well as intra-op threading does. Rounds are
interleaved (ref, layout, ref, layout, ...); step times are medians over rounds, the efficiency is
the median of per-round ratios. The 1-thread reference shows how far intra-op threading itself is
from 2x on this machine.

Bounds are stated against a perfect 2x, so the table also shows

    vs 1t/2 = (1 process, 1 thread step time) / (2 x 2 processes x 1 thread step time)

(efficiency = vs 1t/2 x 2 / speedup, the "2t speedup" column). For PP the 1F1B bubble bounds
vs 1t/2 by m/(m+p-1) only when the stages compute alike. With per-micro-batch stage compute c_r
(forward + backward compute, timed in the same run) a 1F1B step takes at least its compute
critical path

    path = (m-1) * max(c) + sum(c)          (= (m+p-1) c for equal stages)

so the PP line shows the last stage's share of sum(c) (imbalance: it also holds the output layer
and the loss), path / step time (the rest: p2p waits beyond the fill and drain, schedule
bookkeeping, grad sync and the optimizer step), and vs 1t/2 for a step as long as its path.
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
    fmt_spread,
    gpt_flags,
    load_average,
    model_size_args,
    repeat_batch,
    synthetic_batch,
)
from megafab.run.fork_ranks import run_ranks  # noqa: E402
from megafab.timers import Timers  # noqa: E402
from megafab.training.step import train_step  # noqa: E402

LAYOUTS = {  # name: (tp, pp, dp, micro-batches per global batch per DP rank)
    "TP2": (2, 1, 1, 1),
    "DP2": (1, 1, 2, 1),
    "PP2": (1, 2, 1, 4),
}


def _step_seconds(rank, world, args, tp, pp, dp, micro, threads, extra=()):
    torch.set_num_threads(threads)
    mbs = args.batch // (dp * micro)
    flags = gpt_flags(args.layers, args.hidden, args.heads, args.seq, mbs, args.vocab)
    flags[flags.index("--global-batch-size") + 1] = str(args.batch)
    flags += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]
    state = build_state(flags, world_size=world)
    data = repeat_batch(synthetic_batch(mbs, args.seq, args.vocab))
    for _ in range(args.warmup):
        train_step(state, data)
    timers = Timers(2)  # per micro-batch compute; no device to synchronize on CPU
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step(state, data, timers)
    dist.barrier()
    seconds = (time.perf_counter() - start) / args.steps
    compute = sum(timers(name, 2).elapsed for name in ("forward-compute", "backward-compute"))
    return seconds, compute / args.steps


def run_stages(args, tp, pp, dp, micro, world, threads, extra=()) -> tuple[float, list[float]]:
    """(seconds per step of the slowest rank, each rank's forward + backward compute seconds per
    step); `extra`: more Megatron flags (e.g. context parallel)."""
    results = run_ranks(_step_seconds, world, args, tp, pp, dp, micro, threads, extra, timeout=args.timeout)
    return max(r[0] for r in results), [r[1] for r in results]


def run(args, tp, pp, dp, micro, world, threads, extra=()) -> float:
    """Seconds per step of the slowest rank."""
    return run_stages(args, tp, pp, dp, micro, world, threads, extra)[0]


def critical_path(stage_compute: list[float], m: int) -> float:
    """Seconds of the 1F1B compute critical path for per-stage compute seconds (module docstring)."""
    c = [t / m for t in stage_compute]
    return (m - 1) * max(c) + sum(c)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_size_args(ap, layers=4, hidden=512, heads=8, seq=256, vocab=8192)
    ap.add_argument("--batch", type=int, default=8, help="global batch (divisible by 4)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default="TP2,DP2,PP2")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    if args.batch % 4:
        raise SystemExit(f"--batch {args.batch} must be divisible by 4 (DP 2 x 2 and PP 2 x 4 micro-batches)")

    print(f"Scaling, fp32: layers {args.layers}, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, "
          f"global batch {args.batch}, vocab {args.vocab}; {args.steps} steps x {args.rounds} rounds; "
          f"{load_average()}")
    print(f"{'layout':<8}{'micro-batch':>12}{'1p x 1t s/step':>24}{'1p x 2t s/step':>24}"
          f"{'2p x 1t s/step':>24}{'efficiency':>20}{'2t speedup':>12}{'vs 1t/2':>20}")
    pipeline_lines = []
    for name in args.layouts.split(","):
        tp, pp, dp, micro = LAYOUTS[name]
        one_thread, two_threads, layout, paths, shares = [], [], [], [], []
        for _ in range(args.rounds):
            two_threads.append(run(args, 1, 1, 1, dp * micro, 1, 2))
            seconds, compute = run_stages(args, tp, pp, dp, micro, 2, 1)
            layout.append(seconds)
            one_thread.append(run(args, 1, 1, 1, dp * micro, 1, 1))
            paths.append(critical_path(compute, micro))
            shares.append(compute[-1] / sum(compute))
        efficiency = [r / t for r, t in zip(two_threads, layout)]
        vs_one_thread = [r / (2 * t) for r, t in zip(one_thread, layout)]
        speedup = statistics.median(one_thread) / statistics.median(two_threads)
        print(f"{name:<8}{args.batch // (dp * micro):>12}{fmt_spread(one_thread, 3):>24}"
              f"{fmt_spread(two_threads, 3):>24}{fmt_spread(layout, 3):>24}{fmt_spread(efficiency, 2):>20}"
              f"{speedup:>12.2f}{fmt_spread(vs_one_thread, 2):>20}")
        print(f"{'':<8}per round: efficiency {' '.join(f'{e:.2f}' for e in efficiency)}; "
              f"vs 1t/2 {' '.join(f'{e:.2f}' for e in vs_one_thread)}")
        if pp > 1:
            on_path = [c / t for c, t in zip(paths, layout)]
            at_path = [r / (2 * c) for r, c in zip(one_thread, paths)]
            pipeline_lines.append(
                f"{name}: m {micro}, bubble bound m/(m+p-1) {micro / (micro + pp - 1):.2f}; last stage's "
                f"share of the compute {fmt_spread(shares, 2)}; compute critical path / step "
                f"{fmt_spread(on_path, 2)}; vs 1t/2 at the critical path {fmt_spread(at_path, 2)}")
    for line in pipeline_lines:
        print(line)
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
