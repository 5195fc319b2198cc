"""Collectives on this machine's backend (NCCL with GPUs, gloo without), timed in a loop over
fork-started ranks at a group size: all-reduce, all-gather, reduce-scatter, all-to-all and
send/recv by message size -> alpha and bus bandwidth per op (fit: a least-squares line through
time against bytes x the ring factor, weighted by relative error). Each sample is up to
PIPELINED_CALLS calls (fewer for large messages, where the bytes dominate) and one barrier, each
call after a layer's worth of small GEMMs on a CPU (_layer_work), less the same loop without the
calls, per call: as a step's per-layer TP collectives run (a barrier per call would price each at
a barrier's round trip on top; a tight loop of calls keeps the ranks in step, which a layer's
compute between them does not). A CPU profile also fits in-step alphas (steps.py).
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import os
import tempfile

import torch
import torch.distributed as dist

from megafab.calibrate.stats import line, timed

MESSAGE_SIZES = [2**12, 2**16, 2**20, 2**22]
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _one_collective(dist, op, full, shard, rank, world):
    if op == "all_reduce":
        dist.all_reduce(full)
    elif op == "all_gather":
        dist.all_gather_single(full, shard)
    elif op == "reduce_scatter":
        dist.reduce_scatter_single(shard, full)
    elif op == "all_to_all":
        dist.all_to_all_single(full, full.clone())
    elif rank < 2 * (world // 2):  # send/recv between rank pairs
        if rank % 2 == 0:
            dist.send(shard, rank + 1)
            dist.recv(shard, rank + 1)
        else:
            dist.recv(shard, rank - 1)
            dist.send(shard, rank - 1)


PIPELINED_CALLS = 8
MIN_CALL_S = 1e-5  # no collective call is faster (a noisy difference of two loops can say less)


def _calls(size: int) -> int:
    return max(1, min(PIPELINED_CALLS, 2**20 // size))


def _pipelined(dist, op, full, shard, rank, world, calls, work):
    """`calls` collectives (none: op None), each after `work` (a layer's compute), then one barrier."""
    for _ in range(calls):
        work()
        if op is not None:
            _one_collective(dist, op, full, shard, rank, world)
    dist.barrier()


def _layer_work(device):
    """A few small GEMMs between two collectives, as a layer computes between its TP collectives on a
    CPU (ranks arrive unevenly and wake from a wait, unlike in a tight loop); nothing on a GPU,
    whose collectives queue behind the kernels anyway."""
    if device.type != "cpu":
        return lambda: None
    a, b = torch.randn(128, 128), torch.randn(128, 128)

    def work():
        for _ in range(4):
            a @ b
    return work


def _collective_rank(rank: int, world: int, store_path: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    out = {}
    work = _layer_work(device)
    for size in MESSAGE_SIZES:
        elements = size // 4
        full = torch.ones(elements * world, device=device)
        shard = torch.ones(elements, device=device)
        calls = _calls(size)
        repeats = 5 if calls > 1 else 3
        loop = functools.partial(_pipelined, dist, None, full, shard, rank, world, calls, work)
        base = timed(loop, repeats)
        for op in OPS + ("send_recv",):
            nbytes = 2 * elements * 4 if op == "send_recv" else elements * world * 4
            run = functools.partial(_pipelined, dist, op, full, shard, rank, world, calls, work)
            per_call = (timed(run, repeats) - base) / calls
            out.setdefault(op, []).append((nbytes, max(per_call, MIN_CALL_S)))
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def fit(points: list[tuple[float, float]], factor: float, steps: int) -> list[float]:
    """[alpha per step, bus bandwidth] of t = steps * alpha + factor * bytes / busbw, least squares
    of the relative error (weights 1/t^2): the small messages set alpha, the large ones busbw (plain
    least squares lets a large message's noise swamp the intercept)."""
    ys = [t for _, t in points]
    weights = [1 / (t + MIN_CALL_S) ** 2 for t in ys]
    intercept, slope = line([factor * nbytes for nbytes, _ in points], ys, weights)
    slope = max(slope, 1e-15)
    return [max(intercept / max(steps, 1), 0.0), 1.0 / slope]


def measure_collectives(world: int) -> dict:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="megafab-profile-") as tmp:
        procs = [ctx.Process(target=_collective_rank, args=(r, world, os.path.join(tmp, "store"), results))
                 for r in range(world)]
        for p in procs:
            p.start()
        out = results.get(timeout=120)
        for p in procs:
            p.join(timeout=10)
    fitted = {}
    for op, points in out.items():
        n = world if op != "send_recv" else 2
        factor = {"all_reduce": 2.0}.get(op, 1.0) * (n - 1) / n if op != "send_recv" else 0.5
        steps = {"all_reduce": 2 * (n - 1)}.get(op, n - 1) if op != "send_recv" else 2
        alpha, busbw = fit(points, factor, steps)
        if op == "send_recv":  # one transfer: alpha, link bandwidth
            fitted[op] = {"2": [alpha * 2 / 2, busbw]}
        else:
            fitted[op] = {str(n): [alpha, busbw]}
    return fitted
