"""--overlap-param-gather in a torch.profiler trace: DP over every visible GPU (torchrun), the
distributed optimizer with --overlap-grad-reduce --overlap-param-gather, a few steps of a small GPT;
step --profile-step is traced (chrome trace into --out-dir) and its kernels are read back:

    torchrun --nproc-per-node 2 benchmarks/gpu_overlap_trace.py --out-dir results/overlap
    python benchmarks/gpu_overlap_trace.py --trace FILE.json          # only the analysis

Printed: the parameter all-gather kernels' total time, how much of it ran while a compute kernel
(not NCCL) ran on another stream, and when the first all-gather ended relative to the first
compute kernel of the step. Overlap shows as a nonzero overlapped share. Needs 2+ GPUs (NCCL takes
one rank per GPU); with one GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="benchmarks/results/overlap")
    p.add_argument("--trace", help="analyse this chrome trace and exit")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--profile-step", type=int, default=3)
    return p.parse_args(argv)


def overlap_of(trace_path: str) -> dict:
    """All-gather kernel time, and the part of it concurrent with non-NCCL kernels."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    gathers = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "AllGather" in e["name"]]
    compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower())
    overlapped = 0.0
    for start, end in gathers:
        for c_start, c_end in compute:
            if c_start >= end:
                break
            overlapped += max(0.0, min(end, c_end) - max(start, c_start))
    total = sum(end - start for start, end in gathers)
    first_compute = compute[0][0] if compute else None
    return {"trace": trace_path, "all_gather_kernels": len(gathers), "all_gather_us": total,
            "overlapped_us": overlapped, "overlapped_share": overlapped / total if total else 0.0,
            "first_gather_end_minus_first_compute_us":
                (min(e for _, e in gathers) - first_compute) if gathers and compute else None}


def run(args) -> int:
    import torch
    import torch.distributed as dist

    from benchmarks.bench_util import state_of
    from benchmarks.gpu_check import mock_batches
    from megafab.arguments import config_from_args
    from megafab.distributed.topology import initialize
    from megafab.training.step import train_step

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or not torch.cuda.is_available():
        print("gpu_overlap_trace: skipped: needs 2+ GPUs under torchrun (one rank per GPU)")
        return 0
    topo = initialize()
    argv = ["--num-layers", 8, "--hidden-size", 2048, "--num-attention-heads", 16, "--seq-length", 2048,
            "--max-position-embeddings", 2048, "--vocab-size", 32768, "--micro-batch-size", 2,
            "--global-batch-size", 2 * world, "--train-iters", 100, "--lr", "1e-4", "--bf16", "--mock-data",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--ddp-bucket-size", 20_000_000, "--lr-decay-style", "constant"]
    cfg = config_from_args([str(a) for a in argv], world_size=world)
    state = state_of(cfg, topo)
    data = mock_batches(cfg, seed=topo.rank)
    os.makedirs(args.out_dir, exist_ok=True)
    trace = os.path.join(args.out_dir, f"overlap_rank{topo.rank}.json")
    for step in range(1, args.steps + 1):
        if step == args.profile_step:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                train_step(state, data)
                torch.cuda.synchronize()
            prof.export_chrome_trace(trace)
        else:
            train_step(state, data)
    dist.barrier()
    if topo.rank == 0:
        result = overlap_of(trace)
        print(json.dumps(result, indent=2))
        with open(os.path.join(args.out_dir, "overlap.json"), "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    if args.trace:
        for path in glob.glob(args.trace):
            print(json.dumps(overlap_of(path), indent=2))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
