"""The training loop's stall per checkpoint save, synchronous vs --async-save (issue 40).

Two gloo ranks (DP 2 + distributed optimizer) run pretrain_gpt.py's main(), forked from this script,
once per mode with the same flags, saving every --save-interval iterations into a temporary --save
directory. The stall is the time the loop spends in its checkpoint calls (the save itself; with
--async-save also the finalize checks at each iteration start and the wait at the end): the slower
rank's total, per save; and its parts: the first save (with --async-save the one-time allocation of
the host staging memory), the later saves (median; each with the finalize checks before it), and the
end-of-training wait for the last write. Each step's time is recorded too, split by whether this
rank's background writer was writing during it. Rounds alternate sync and async.

    python benchmarks/checkpoint_speed.py                       # ~50M parameters, 3 saves per run
    python benchmarks/checkpoint_speed.py --layers 2 --hidden 64 --vocab 1024 --iters 4   # tiny
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_util import gpt_flags, load_average, model_size_args  # noqa: E402


def _instrument(stats: dict) -> None:
    """In a rank: time the loop's checkpoint calls and its steps (overlapping a write or not)."""
    from megafab.training import checkpoint_cadence, pretrain

    cadence = checkpoint_cadence.CheckpointCadence
    stats.update(stall=0.0, saves=0, steps_writing=[], steps_idle=[], calls=[])
    current = {}

    def timed(name):
        method = getattr(cadence, name)

        def run(self, *args, **kwargs):
            current["cadence"] = self
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                took = time.perf_counter() - start
                stats["stall"] += took
                stats["saves"] += name == "save"
                stats["calls"].append((name, took))
        setattr(cadence, name, run)

    for name in ("save", "at_iteration_start", "finish"):
        timed(name)
    step = pretrain.train_step

    def timed_step(*args, **kwargs):
        saver = getattr(current.get("cadence"), "saver", None)
        writing = saver is not None and saver.pending is not None and not saver.pending.write.done()
        start = time.perf_counter()
        out = step(*args, **kwargs)
        stats["steps_writing" if writing else "steps_idle"].append(time.perf_counter() - start)
        return out
    pretrain.train_step = timed_step


def _rank(rank: int, world: int, port: int, flags: list[str], out_path: str) -> None:
    code = 1
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        import torch

        torch.set_num_threads(1)
        from pretrain_gpt import main

        stats: dict = {}
        _instrument(stats)
        code = main(flags) or 0
        with open(out_path, "w") as f:
            json.dump(stats, f)
    finally:
        os._exit(code)


def run_once(flags: list[str], world: int, workdir: str) -> list[dict]:
    from megafab.run.launch import free_port

    port, pids, outs = free_port(), [], []
    for rank in range(world):
        outs.append(os.path.join(workdir, f"stats{rank}.json"))
        pid = os.fork()
        if pid == 0:
            _rank(rank, world, port, flags, outs[-1])
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"a rank failed ({status}): rerun with smaller sizes"
    return [json.load(open(p)) for p in outs]


def _ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):8.0f}" if values else "       -"


def _phases(stats: dict) -> tuple[float, list[float], float]:
    """(the first save, each later save with the finalize checks before it, the end-of-training wait)
    of one rank: the one-time host allocation, the steady state, and the wait no iteration hides."""
    saves, pending, end = [], 0.0, 0.0
    for name, took in stats["calls"]:
        if name == "save":
            saves.append(pending + took)
            pending = 0.0
        elif name == "at_iteration_start":
            pending += took
        else:
            end += took + pending
            pending = 0.0
    return saves[0], saves[1:], end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_size_args(ap, layers=2, hidden=768, heads=12, seq=128, vocab=50304)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--save-interval", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    a = ap.parse_args()
    import pretrain_gpt  # noqa: F401 - imported once, before forking, so that every rank starts warm
    from megafab.checkpoint import dcp_async  # noqa: F401

    base = gpt_flags(a.layers, a.hidden, a.heads, a.seq, 1, a.vocab) + ["--global-batch-size", "2",
        "--train-iters", str(a.iters), "--save-interval", str(a.save_interval), "--use-distributed-optimizer",
        "--log-interval", "1000", "--eval-iters", "0"]
    modes = {"sync": [], "async": ["--async-save", "--use-persistent-ckpt-worker"]}
    print(f"checkpoint stall per save, 2 gloo ranks DP 2 + distributed optimizer; {a.layers} layers, hidden "
          f"{a.hidden}, vocab {a.vocab}; {a.iters} iterations, a save every {a.save_interval}; "
          f"{load_average()}")
    print(f"{'round':>5} {'mode':>6} {'saves':>5} {'stall/save ms':>14} {'first':>6} {'later':>6} {'end':>6} "
          f"{'MiB/rank':>9} {'step ms idle':>13} {'step ms writing':>16}")
    ratios, steady = [], []
    for r in range(a.rounds):
        per_mode = {}
        for mode, extra in modes.items():
            work = tempfile.mkdtemp(prefix="megafab_ckpt_speed_", dir=a.dir)
            try:
                stats = run_once(base + extra + ["--save", os.path.join(work, "ckpt")], 2, work)
                size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(work) for f in fs
                           if f.endswith(".distcp")) / 2 ** 20
                n_saves = os.listdir(os.path.join(work, "ckpt"))
                n_saves = sum(1 for d in n_saves if d.startswith("iter_"))
            finally:
                shutil.rmtree(work, ignore_errors=True)
            slow = max(stats, key=lambda s: s["stall"])
            stall = slow["stall"] / max(slow["saves"], 1)
            first, later, end = _phases(slow)
            per_mode[mode] = (stall, statistics.median(later) if later else first)
            writing = [t for s in stats for t in s["steps_writing"]]
            idle = [t for s in stats for t in s["steps_idle"]]
            per_rank = size / max(n_saves, 1) / 2
            print(f"{r:>5} {mode:>6} {slow['saves']:>5} {1000 * stall:>14.0f} {1000 * first:>6.0f} "
                  f"{_ms(later).strip():>6} {1000 * end:>6.0f} {per_rank:>9.1f} {_ms(idle):>13} "
                  f"{_ms(writing):>16}")
        ratios.append(per_mode["async"][0] / per_mode["sync"][0])
        steady.append(per_mode["async"][1] / per_mode["sync"][1])
    print(f"async stall / sync stall, all saves with the end-of-training wait: median "
          f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]; the saves after the "
          f"first: median {statistics.median(steady):.3f} [{min(steady):.3f}-{max(steady):.3f}]; over "
          f"{len(ratios)} round(s)")


if __name__ == "__main__":
    main()
