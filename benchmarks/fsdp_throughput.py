"""Throughput of ZeRO-3 against ZeRO-1 on this machine: DP 2 with torch FSDP2 (--use-torch-fsdp2)
and DP 2 with the distributed optimizer, same model, global batch and micro-batches; optionally
also with optimizer CPU offload.

    python benchmarks/fsdp_throughput.py [--layers 4 --hidden 512 --heads 8 --seq 256 --batch 8
                                          --vocab 8192 --micro 2 --steps 3 --warmup 2 --rounds 3 --offload]

Two gloo processes, one thread each, fp32, megafab's build_model / build_optimizer / train_step on
one fixed synthetic batch per micro-batch. Rounds are interleaved (dist-opt, FSDP2, [offload],
dist-opt, ...); per round, tokens/s of each variant and the ratio FSDP2 / dist-opt (the ratio is
what to read: the machine's load moves both). FSDP2 gathers every layer's weights twice per
micro-batch (forward and, after resharding, backward) and reduce-scatters once per step; the
distributed optimizer reduce-scatters the grads and all-gathers the weights once per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_util import load_average, model_size_args  # noqa: E402
from benchmarks.scaling import run  # noqa: E402

VARIANTS = {"dist-opt": ["--use-distributed-optimizer"], "FSDP2": ["--use-torch-fsdp2"],
            "FSDP2+offload": ["--use-torch-fsdp2", "--optimizer-cpu-offload"]}


def _tokens_per_second(args, extra) -> float:
    """DP 2, one thread per rank, `args.micro` micro-batches per rank: tokens/s of the slowest rank."""
    return args.batch * args.seq / run(args, 1, 1, 2, args.micro, 2, 1, extra)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_size_args(ap, layers=4, hidden=512, heads=8, seq=256, vocab=8192)
    ap.add_argument("--batch", type=int, default=8, help="global batch (divisible by 2 x --micro)")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per DP rank per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (Adam state, FSDP2 init)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--offload", action="store_true", help="also FSDP2 with optimizer CPU offload")
    ap.add_argument("--timeout", type=float, default=1200.0)
    args = ap.parse_args(argv)
    names = [n for n in VARIANTS if args.offload or n != "FSDP2+offload"]
    print(f"DP 2, fp32: layers {args.layers}, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, "
          f"global batch {args.batch} in {args.micro} micro-batches per rank, vocab {args.vocab}; "
          f"{load_average()}")
    print(f"{'round':<7}" + "".join(f"{n + ' tok/s':>20}" for n in names) + f"{'FSDP2/dist-opt':>16}")
    ratios = []
    for r in range(args.rounds):
        speeds = [_tokens_per_second(args, VARIANTS[n]) for n in names]
        ratios.append(speeds[1] / speeds[0])
        print(f"{r:<7}" + "".join(f"{s:>20.0f}" for s in speeds) + f"{ratios[-1]:>16.3f}")
    print(f"median FSDP2/dist-opt tokens/s ratio {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}]; after: {load_average()}")


if __name__ == "__main__":
    main()
