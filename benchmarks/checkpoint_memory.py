"""Peak resident memory per rank of distributed-optimizer runs that save a checkpoint every
iteration, or load one and continue, against the same run without checkpoints; and per-rank save
time at DP 1 / 2 / 4. The real driver (pretrain_gpt.py under torchrun, gloo, fp32, mock data).

    python benchmarks/checkpoint_memory.py [--layers 12 --hidden 512 --heads 8 --seq 128
                                            --vocab 32000 --iters 4 --bucket 500000]

Runs (DP 4 unless stated (--dp), --use-distributed-optimizer, --ddp-bucket-size below the size of the
large matrices, so every rank owns a slice of each):
    no saves          --train-iters N
    save every iter   the same with --save DIR --save-interval 1
    load + continue   --load DIR from iteration N/2 to N (its losses must equal the others')
    DP 1, DP 2        save every iteration, for the save time per rank
Per rank: the resident-set high-water mark (VmHWM, /proc/self/status) of the run, wall and CPU
seconds of each save_checkpoint, bytes of the boxes it hands to DCP, and measure_memory's
weights + grads + optimizer bytes next to planner.plan(cfg).state_bytes.

Peak RSS is the larger of two phases: start-up (imports, configuration) and training (model,
optimizer, the load in the load run, steps and saves). The mock-data index build between them (pretrain
builds the datasets before the model) is left out: its transient is the same in every run and larger
than either phase at small sizes (it is printed).
The high-water mark is reset after it by writing 5 to /proc/self/clear_refs.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RECORDS_ENV = "MEGAFAB_CHECKPOINT_BENCH_DIR"  # each rank writes rank_<r>.json there at exit


# ---- inside each rank ------------------------------------------------------------------------------
def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def rank_entry(argv: list[str]) -> int:
    """Run pretrain_gpt.py's main with timers around save_checkpoint and a report at exit."""
    import pretrain_gpt
    from megafab.checkpoint import checkpointing, dcp_io
    from megafab.optim.memory import measure_memory
    from megafab.training import pretrain

    record = {"rank": int(os.environ.get("RANK", "0")), "save_s": [], "save_cpu_s": [], "written": 0,
              "state_bytes": None}
    save, write, step = checkpointing.save_checkpoint, dcp_io.save_shards, pretrain.train_step
    build_data = pretrain.build_datasets  # the mock-data index build (pretrain builds the datasets first)

    def data_then_reset(*args, **kwargs):
        record["hwm_setup_kib"] = _vm_kib("VmHWM")
        out = build_data(*args, **kwargs)
        record["hwm_data_kib"] = _vm_kib("VmHWM")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        return out

    def timed_save(state, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        out = save(state, *args, **kwargs)
        record["save_s"].append(time.perf_counter() - wall)
        record["save_cpu_s"].append(time.process_time() - cpu)
        return out

    def counted_write(shards, path, objects=None):
        record["written"] += sum(v.nbytes for s in shards.values() if s.write for v in s.views)
        return write(shards, path, objects)

    def measured_step(state, data_iterator, *timers):
        out = step(state, data_iterator, *timers)
        record["state_bytes"] = measure_memory(state.model, state.optimizer).total_bytes
        return out

    checkpointing.save_checkpoint, dcp_io.save_shards, pretrain.train_step = timed_save, counted_write, \
        measured_step
    pretrain.build_datasets = data_then_reset

    def report():
        record["hwm_train_kib"] = _vm_kib("VmHWM")
        record["hwm_kib"] = max(record["hwm_setup_kib"], record["hwm_train_kib"])
        with open(os.path.join(os.environ[RECORDS_ENV], f"rank_{record['rank']}.json"), "w") as f:
            json.dump(record, f)

    atexit.register(report)
    return pretrain_gpt.main(argv)


# ---- the driver --------------------------------------------------------------------------------------
def model_flags(args) -> list[str]:
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
            "--max-position-embeddings", str(args.seq), "--vocab-size", str(args.vocab - 1),  # + eod
            "--make-vocab-size-divisible-by", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(args.iters),
            "--lr", "1e-4", "--lr-warmup-iters", "1", "--mock-data", "--num-workers", "0",
            "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0",
            "--use-distributed-optimizer", "--ddp-bucket-size", str(args.bucket)] + (
                ["--data-cache-path", args.data_cache_path] if args.data_cache_path else [])


def launch(nproc: int, flags: list[str], cwd: str, timeout: float) -> tuple[dict[int, float], list[dict]]:
    from megafab.cli.plot import parse_log_lines
    from megafab.run.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__), "--rank-entry", *flags]
    records_dir = tempfile.mkdtemp(dir=cwd)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, RECORDS_ENV: records_dir}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    if out.returncode != 0:
        raise SystemExit(f"run failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    records = []
    for rank in range(nproc):
        with open(os.path.join(records_dir, f"rank_{rank}.json")) as f:
            records.append(json.load(f))
    return parse_log_lines(out.stdout.splitlines()).series["train_loss"], records


def memory_rows(args, flags, stage, work: str, ckpt: str) -> list[dict]:
    """The DP --dp table; returns the records of the run that saves every iteration."""
    from megafab.checkpoint.directory import TRACKER

    mib = 1024 * 1024
    saving = flags + ["--save", ckpt, "--save-interval", "1"]
    runs = {"no saves": launch(args.dp, flags, work, args.timeout),
            "save every iter": launch(args.dp, saving, work, args.timeout)}
    half = args.iters // 2
    with open(os.path.join(ckpt, TRACKER), "w") as f:
        f.write(str(half))
    runs["load + continue"] = launch(args.dp, flags + ["--load", ckpt], work, args.timeout)
    base_losses, base = runs["no saves"]
    base_hwm = max(r["hwm_kib"] for r in base)
    print(f"{f'DP {args.dp} run':<18}{'peak RSS MiB (max rank)':>24}{'vs no saves':>13}{'state MiB':>11}"
          f"{'plan state':>12}  losses equal")
    for name, (got, records) in runs.items():
        hwm = max(r["hwm_kib"] for r in records)
        state = max(r["state_bytes"] for r in records) / mib
        same = all(got[i] == base_losses[i] for i in got) and sorted(got) == (
            list(range(half + 1, args.iters + 1)) if name.startswith("load") else sorted(base_losses))
        print(f"{name:<18}{hwm / 1024:>24.0f}{hwm / base_hwm:>12.3f}x{state:>11.1f}"
              f"{stage.state_bytes / mib:>12.1f}  {'yes' if same else 'NO'}", flush=True)
    print("peak RSS MiB (max rank) start-up / training phase: " + ", ".join(
        f"{name} {max(r['hwm_setup_kib'] for r in rec) / 1024:.0f} / "
        f"{max(r['hwm_train_kib'] for r in rec) / 1024:.0f}" for name, (_, rec) in runs.items()))
    print(f"mock-data index build (left out): {max(r['hwm_data_kib'] for r in base) / 1024:.0f} MiB; "
          f"unsharded fp32 Adam state (what each rank used to assemble to save): "
          f"{2 * 4 * stage.params / mib:.0f} MiB", flush=True)
    return runs["save every iter"][1]


def save_time_rows(args, flags, work: str, ckpt: str, table_records: list[dict] | None) -> None:
    mib = 1024 * 1024
    print(f"{'DP':<4}{'save wall s/rank':>18}{'save CPU s/rank':>17}{'MiB written/rank':>18}"
          f"{'peak RSS MiB':>14}   (checkpoints in {os.path.dirname(ckpt)})")
    for dp in [int(d) for d in args.dp_sizes.split(",")]:
        if dp == args.dp and table_records is not None:
            records = table_records
        else:
            shutil.rmtree(ckpt, ignore_errors=True)
            records = launch(dp, flags + ["--save", ckpt, "--save-interval", "1"], work, args.timeout)[1]
        # per rank: the median over its saves; then the median over ranks
        wall = statistics.median(statistics.median(r["save_s"]) for r in records)
        cpu = statistics.median(statistics.median(r["save_cpu_s"]) for r in records)
        written = statistics.median(r["written"] / len(r["save_s"]) for r in records) / mib
        hwm = max(r["hwm_kib"] for r in records) / 1024
        print(f"{dp:<4}{wall:>18.2f}{cpu:>17.2f}{written:>18.1f}{hwm:>14.0f}", flush=True)


def main(argv=None):
    from benchmarks.bench_util import load_average, model_size_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_size_args(ap, layers=12, hidden=512, heads=8, seq=128, vocab=32000,
                    vocab_help="padded vocabulary (tokens + eod)")
    ap.add_argument("--iters", type=int, default=4, help="even; the load run resumes at iters / 2")
    ap.add_argument("--bucket", type=int, default=500_000, help="--ddp-bucket-size (elements)")
    ap.add_argument("--dp", type=int, default=4, help="DP size of the memory table (global batch 4)")
    ap.add_argument("--dp-sizes", default="1,2,4", help="DP sizes of the save-time rows")
    ap.add_argument("--rows", choices=["all", "memory", "save-time"], default="all")
    ap.add_argument("--save-dir", default=None,
                    help="where checkpoints go (default: a temporary directory; /dev/shm takes the disk "
                         "out of the save times)")
    ap.add_argument("--data-cache-path", default=None,
                    help="passed to every run: the mock-data indices are built once, not by every rank of "
                         "every run (smoke runs; the build is left out of the table either way)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)

    from megafab.arguments import config_from_args
    from megafab.plan.planner import plan

    flags = model_flags(args)
    stage = plan(config_from_args(flags, world_size=args.dp), kernels="cpu")[0]
    work = tempfile.mkdtemp(prefix="megafab_ckpt_bench_")
    saves = tempfile.mkdtemp(prefix="megafab_ckpt_bench_", dir=args.save_dir) if args.save_dir else work
    ckpt = os.path.join(saves, "ckpt")
    print(f"Checkpoint memory per rank: {stage.params / 1e6:.1f}M parameters, fp32, layers {args.layers}, "
          f"hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}, global batch 4, distributed optimizer, "
          f"--ddp-bucket-size {args.bucket}, {args.iters} iterations; {load_average()}", flush=True)
    try:
        table = memory_rows(args, flags, stage, work, ckpt) if args.rows in ("all", "memory") else None
        if args.rows in ("all", "save-time"):
            save_time_rows(args, flags, work, ckpt, table)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(saves, ignore_errors=True)
    print(f"after: {load_average()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-entry"]:
        sys.exit(rank_entry(sys.argv[2:]))
    main()
