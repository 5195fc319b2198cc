"""megafab-estimate --profile: measure this machine into a Machine profile the step-time model uses.

Measured, each as the median of a few timed repeats after a warm-up:
  GEMMs of the model dtype over a range of shapes (the profile's gemm_points: the model interpolates
      the achieved rate by GEMM size instead of using the analytic curve);
  attention forward and backward (torch SDPA, causal) -> attention efficiencies of the peak;
  a streaming element-wise kernel -> HBM (memory) bandwidth;
  all-reduce, all-gather, reduce-scatter, all-to-all and send/recv by size over group sizes 2 and
      4 (where the machine has the cores) on the backend a run would use (NCCL with GPUs, gloo
      without), with fork-started ranks -> alpha and bus bandwidth per op and group size (a
      least-squares line through time against bytes x the ring factor).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import statistics
import tempfile
import time

from megafab.plan.machines import Machine

GEMM_SHAPES = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (256, 512, 256), (512, 512, 512),
               (1024, 512, 512), (1024, 1024, 1024), (2048, 1024, 1024)]
MESSAGE_SIZES = [2**12, 2**16, 2**20, 2**22]
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _mm(a, b, device):
    a @ b
    _sync(device)


def measure_gemms(dtype, deadline: float) -> list:
    import torch

    device = _device()
    name = str(dtype).replace("torch.", "")
    rows = []
    for m, n, k in GEMM_SHAPES:
        if time.monotonic() > deadline:
            break
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        rows.append([m, n, k, name, _timed(functools.partial(_mm, a, b, device))])
    return rows


def measure_attention(dtype, peak: float) -> tuple[float, float]:
    """(forward, backward) efficiency of causal SDPA relative to `peak` FLOP/s, the kernel's own FLOPs."""
    import torch
    import torch.nn.functional as F

    device = _device()
    b, heads, s, d = 1, 4, 256, 32
    q, k, v = (torch.randn(b, heads, s, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    flops = 4 * b * heads * s * s * d / 2

    def forward():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        _sync(device)

    def backward():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        _sync(device)

    fwd = _timed(forward)
    both = _timed(backward)
    return flops / fwd / peak, 2.5 * flops / max(both - fwd, fwd) / peak


def measure_bandwidth() -> float:
    import torch

    device = _device()
    x = torch.empty(2**24, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)

    def run():
        torch.mul(x, 2.0, out=y)
        _sync(device)

    return 2 * x.numel() * 4 / _timed(run)


def _one_collective(dist, op, full, shard, rank, world):
    if op == "all_reduce":
        dist.all_reduce(full)
    elif op == "all_gather":
        dist.all_gather_into_tensor(full, shard)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, full)
    elif op == "all_to_all":
        dist.all_to_all_single(full, full.clone())
    elif rank < 2 * (world // 2):  # send/recv between rank pairs
        if rank % 2 == 0:
            dist.send(shard, rank + 1)
            dist.recv(shard, rank + 1)
        else:
            dist.recv(shard, rank - 1)
            dist.send(shard, rank - 1)
    dist.barrier()


def _collective_rank(rank: int, world: int, store_path: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    out = {}
    for size in MESSAGE_SIZES:
        elements = size // 4
        full = torch.ones(elements * world, device=device)
        shard = torch.ones(elements, device=device)
        for op in OPS + ("send_recv",):
            nbytes = 2 * elements * 4 if op == "send_recv" else elements * world * 4
            run = functools.partial(_one_collective, dist, op, full, shard, rank, world)
            out.setdefault(op, []).append((nbytes, _timed(run, repeats=3)))
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def _fit(points: list[tuple[float, float]], factor: float, steps: int) -> list[float]:
    """[alpha per step, bus bandwidth] of t = steps * alpha + factor * bytes / busbw (least squares)."""
    xs = [factor * nbytes for nbytes, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30)
    slope = max(slope, 1e-15)
    alpha = max((my - slope * mx) / max(steps, 1), 0.0)
    return [alpha, 1.0 / slope]


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
        alpha, busbw = _fit(points, factor, steps)
        if op == "send_recv":  # one transfer: alpha, link bandwidth
            fitted[op] = {"2": [alpha * 2 / 2, busbw]}
        else:
            fitted[op] = {str(n): [alpha, busbw]}
    return fitted


def measure(name: str = "this-machine", budget_s: float = 90.0) -> Machine:
    import torch

    device = _device()
    cores = os.cpu_count() or 1
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    sizes = [n for n in (2, 4) if (n <= gpus if gpus else n <= max(2, 2 * cores))]
    collectives: dict = {}
    for n in sizes:  # first: ranks are forked before this process starts any compute thread pool
        for op, table in measure_collectives(n).items():
            collectives.setdefault(op, {}).update(table)
    deadline = time.monotonic() + budget_s * 0.5
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    if device.type == "cpu":
        torch.set_num_threads(1)  # as each rank runs (one thread per rank)
    gemms = []
    for dtype in dtypes:
        gemms += measure_gemms(dtype, deadline)
    peaks = {}
    for row in gemms:
        peaks[row[3]] = max(peaks.get(row[3], 0.0), 2.0 * row[0] * row[1] * row[2] / row[4] / 1e12)
    att_f, att_b = measure_attention(dtypes[-1], 1e12 * peaks[str(dtypes[-1]).replace("torch.", "")])
    bandwidth = measure_bandwidth()
    ring = collectives.get("all_gather", {}).get("2", [5e-5, 1e9])
    link = collectives.get("send_recv", {}).get("2", ring)
    if device.type == "cuda":
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Machine(
        name=name, peak_tflops=peaks, device_memory_gib=memory_gib, hbm_bandwidth=bandwidth,
        gpus_per_node=max(gpus, 1024), intra_busbw=ring[1], intra_latency_s=ring[0], nic_bandwidth=link[1],
        inter_latency_s=link[0], gemm_efficiency=1.0, kernel_overhead_s=0.0,
        attention_fwd_efficiency=att_f, attention_bwd_efficiency=att_b, attention_seq_half=0.0,
        hbm_efficiency=1.0, gemm_points=gemms, collectives=collectives, iteration_overhead_s=0.0,
        host_memory_gib=memory_gib, compute_slots=0 if gpus else cores,
        source=f"measured by megafab-estimate --profile on {device.type}")
