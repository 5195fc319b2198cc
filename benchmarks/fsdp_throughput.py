"""Throughput of ZeRO-3 against ZeRO-1 on this machine: DP 2 with torch FSDP2 (--use-torch-fsdp2)
and DP 2 with the distributed optimizer, same model, global batch and micro-batches; optionally
also with optimizer CPU offload.

    python benchmarks/fsdp_throughput.py [--layers 4 --hidden 512 --heads 8 --seq 256 --batch 8
                                          --vocab 8192 --micro 2 --steps 3 --rounds 3 --offload]

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
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_util import build_state, gpt_flags, load_average, repeat_batch, synthetic_batch  # noqa: E402
from megafab.training.step import train_step  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

VARIANTS = {"dist-opt": ["--use-distributed-optimizer"], "FSDP2": ["--use-torch-fsdp2"],
            "FSDP2+offload": ["--use-torch-fsdp2", "--optimizer-cpu-offload"]}


def _tokens_per_second(rank, world, args, extra):
    torch.set_num_threads(1)
    mbs = args.batch // (2 * args.micro)
    flags = gpt_flags(args.layers, args.hidden, args.heads, args.seq, mbs, args.vocab) + extra
    flags[flags.index("--global-batch-size") + 1] = str(args.batch)
    state = build_state(flags, world_size=world)
    data = repeat_batch(synthetic_batch(mbs, args.seq, args.vocab))
    for _ in range(2):  # warm-up: Adam state, FSDP2's lazy init, allocator
        train_step(state, data)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step(state, data)
    dist.barrier()
    return args.steps * args.batch * args.seq / (time.perf_counter() - start)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch (divisible by 2 x --micro)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per DP rank per step")
    ap.add_argument("--steps", type=int, default=3)
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
        speeds = [min(run_ranks(_tokens_per_second, 2, args, VARIANTS[n], timeout=args.timeout))
                  for n in names]
        ratios.append(speeds[1] / speeds[0])
        print(f"{r:<7}" + "".join(f"{s:>20.0f}" for s in speeds) + f"{ratios[-1]:>16.3f}")
    print(f"median FSDP2/dist-opt tokens/s ratio {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}]; after: {load_average()}")


if __name__ == "__main__":
    main()
