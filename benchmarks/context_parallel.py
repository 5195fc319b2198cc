"""Context parallelism on this machine: activation memory per rank at CP 1, 2, 4 for each comm
type (measured and planned) and CP 2's step-time efficiency against one process with 2 threads.

    python benchmarks/context_parallel.py [--layers 2 --hidden 64 --heads 4 --seq 8192 --vocab 1024]
                                          [--speed-seq 2048 --speed-hidden 256 --speed-heads 8 ...]

Memory (fp32, micro-batch 1, dropout off): "saved act." is the bytes autograd keeps for backward
during one micro-batch forward on rank 0 (benchmarks/memory.py's saved_bytes: distinct storages,
parameters excluded); "ideal" is the CP 1 figure / cp; "plan" is planner.plan(cfg,
kernels="flash")'s activation bytes per micro-batch (PyTorch's CPU SDPA runs its flash kernel
without dropout), and "K/V exch." the planner's transient exchange buffers.

Speed (fp32, dropout off): efficiency = (1 process x 2 threads s/step) / (CP 2: 2 processes x 1
thread s/step), same global batch and sequence, interleaved rounds (as benchmarks/scaling.py).
"""

from __future__ import annotations

import argparse
import os
import sys

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
from benchmarks.memory import saved_bytes  # noqa: E402
from benchmarks.scaling import run as step_seconds  # noqa: E402
from megafab.arguments import config_from_args  # noqa: E402
from megafab.plan.planner import plan  # noqa: E402
from megafab.run.fork_ranks import run_ranks  # noqa: E402

MEMORY_LAYOUTS = [(1, "p2p")] + [(cp, comm) for cp in (2, 4) for comm in ("p2p", "allgather", "a2a")]


def _flags(args, cp: int, comm: str) -> list[str]:
    return gpt_flags(args.layers, args.hidden, args.heads, args.seq, 1, args.vocab) + [
        "--context-parallel-size", str(cp), "--cp-comm-type", comm]


def _saved_on_rank(rank, world, flags):
    state = build_state(flags, world_size=world)
    cfg = state.cfg
    data = repeat_batch(synthetic_batch(1, cfg.model.seq_length, cfg.model.vocab_size))
    return saved_bytes(state, data)


def memory(args) -> None:
    mib = 2.0**20
    print(f"Saved activations per rank, fp32: layers {args.layers}, hidden {args.hidden}, heads "
          f"{args.heads}, seq {args.seq}, micro-batch 1, vocab {args.vocab}; MiB; {load_average()}")
    print(f"{'layout':<16}{'saved act.':>12}{'ideal':>10}{'vs ideal':>10}{'plan':>10}{'plan/saved':>12}"
          f"{'K/V exch.':>11}")
    base = None
    for cp, comm in MEMORY_LAYOUTS:
        flags = _flags(args, cp, comm)
        saved = run_ranks(_saved_on_rank, cp, flags, timeout=args.timeout)[0]
        base = saved if cp == 1 else base
        stage = plan(config_from_args(flags, world_size=cp), kernels="flash")[0]
        planned = stage.activation_bytes_per_micro_batch
        name = "CP1" if cp == 1 else f"CP{cp} {comm}"
        print(f"{name:<16}{saved / mib:>12.1f}{base / cp / mib:>10.1f}{saved / (base / cp):>10.3f}"
              f"{planned / mib:>10.1f}{planned / saved:>12.3f}{stage.kv_exchange_bytes / mib:>11.1f}")


def speed(args) -> None:
    ns = argparse.Namespace(layers=args.speed_layers, hidden=args.speed_hidden, heads=args.speed_heads,
                            seq=args.speed_seq, batch=args.speed_batch, vocab=args.vocab, steps=args.steps,
                            warmup=1, timeout=args.timeout)
    print(f"\nCP 2 step time, fp32: layers {ns.layers}, hidden {ns.hidden}, heads {ns.heads}, seq "
          f"{ns.seq}, global batch {ns.batch}, vocab {ns.vocab}; {ns.steps} steps x {args.rounds} rounds; "
          f"{load_average()}")
    print(f"{'layout':<16}{'1p x 2t s/step':>24}{'2p x 1t s/step':>24}{'efficiency':>20}  per round")
    for comm in args.comm_types.split(","):
        two_threads, layout = [], []
        for _ in range(args.rounds):
            two_threads.append(step_seconds(ns, 1, 1, 1, 1, 1, 2))
            layout.append(step_seconds(ns, 1, 1, 1, 1, 2, 1, ["--context-parallel-size", "2",
                                                             "--cp-comm-type", comm]))
        efficiency = [r / t for r, t in zip(two_threads, layout)]
        print(f"{'CP2 ' + comm:<16}{fmt_spread(two_threads, 3):>24}{fmt_spread(layout, 3):>24}"
              f"{fmt_spread(efficiency, 2):>20}  {' '.join(f'{e:.2f}' for e in efficiency)}  "
              f"({load_average()})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_size_args(ap, layers=2, hidden=64, heads=4, seq=8192, vocab=1024)
    ap.add_argument("--speed-layers", type=int, default=2)
    ap.add_argument("--speed-hidden", type=int, default=256)
    ap.add_argument("--speed-heads", type=int, default=8)
    ap.add_argument("--speed-seq", type=int, default=2048)
    ap.add_argument("--speed-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--comm-types", default="p2p,allgather,a2a")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    if not args.skip_memory:
        memory(args)
    if not args.skip_speed:
        speed(args)
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
