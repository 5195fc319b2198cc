"""Run a function on N real gloo processes forked from this one (tests, benchmarks).

    results = run_ranks(fn, world_size=4, timeout=30)   # fn(rank, world_size) -> picklable

Processes are forked (8 ranks start in well under a second; start no thread pool in the parent
first; modules every rank needs are imported here, once), rendezvous through a file store, and
every collective has `timeout` seconds. A rank that raises makes run_ranks raise RankFailure with
its rank and traceback; ranks that hang make it raise RankTimeout naming the ranks that never
finished.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback


class RankFailure(AssertionError):
    """One or more ranks raised or died; the message carries each rank's traceback."""


class RankTimeout(AssertionError):
    """Ranks did not finish in time (hung collective, deadlock)."""


def _child(fn, rank, world_size, store_path, timeout, env, args, kwargs, results):
    try:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                           "OMP_NUM_THREADS": "1", **env})
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle bytes: torch's queue reductions would pass tensors as shared-memory file
        # descriptors, which die with this process before the parent reads them.
        results.put(("ok", rank, pickle.dumps(value)))
        # A rank that exits while a slower peer is still connecting its gloo mesh makes that peer
        # fail with "connection closed by peer": leave together (a function that ended the
        # process group itself, like pretrain(), already did).
        # A peer that hangs makes this barrier time out: that is the peer's failure, already
        # reported as a timeout, not this rank's.
        if dist.is_initialized():
            try:
                dist.barrier()
            except RuntimeError:
                pass
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        results.close()
        results.join_thread()  # flush the message before os._exit
        # Skip pytest's and torch's atexit machinery inherited through fork.
        os._exit(0)


def import_rank_modules() -> None:
    """Before forking: what every rank would import on its own (a first optimizer imports
    torch._dynamo, ~1.5 s of CPU per rank), imported once in the parent."""
    import torch._dynamo  # noqa: F401


def run_ranks(fn, world_size: int, *args, timeout: float = 60.0, env: dict | None = None,
              grace: float = 2.0, **kwargs) -> list:
    """Run fn(rank, world_size, *args, **kwargs) on world_size processes; return their results.

    timeout bounds the whole run and each collective. After the first failure the others get
    `grace` seconds to report (they are often stuck waiting for the failed rank), then are killed.
    """
    import_rank_modules()
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="megafab-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        # Not daemonic: ranks may start their own children (DataLoader workers); the finally
        # below kills whatever is still alive.
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, store, timeout, env or {},
                                                  args, kwargs, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout
        first_error_at = None
        try:
            while len(outcome) < world_size:
                now = time.monotonic()
                if now > deadline or (first_error_at is not None and now > first_error_at + grace):
                    break
                try:
                    status, rank, value = results.get(timeout=0.05)
                    outcome[rank] = (status, value)
                    if status == "error" and first_error_at is None:
                        first_error_at = time.monotonic()
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if r not in outcome and p.exitcode is not None and p.exitcode != 0:
                            outcome[r] = ("error", f"process exited with code {p.exitcode}")
                            first_error_at = first_error_at or time.monotonic()
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)

    # Arrival order puts the root cause first: the others usually fail because it vanished.
    errors = [(r, v) for r, (s, v) in outcome.items() if s == "error"]
    if errors:
        first, tb = errors[0]
        others = sorted(r for r, _ in errors[1:])
        text = f"rank {first} of {world_size} failed first:\n{tb}"
        if others:
            text += f"\nthen rank(s) {others} failed too (first of them:)\n{errors[1][1]}"
        raise RankFailure(text)
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        raise RankTimeout(f"rank(s) {missing} of {world_size} did not finish within {timeout:.0f} s "
                          f"(hung collective or deadlock)")
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
