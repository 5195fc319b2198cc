"""megafab-estimate --profile: measure this machine into a Machine profile the step-time model uses.

Measured, each as the median of a few timed repeats after a warm-up:
  GEMMs of the model dtype over a range of shapes (the profile's gemm_points: the model interpolates
      the achieved rate by GEMM size instead of using the analytic curve);
  attention forward and backward (torch SDPA, causal) -> attention efficiencies of the peak;
  a streaming element-wise kernel -> HBM (memory) bandwidth;
  all-reduce, all-gather, reduce-scatter, all-to-all and send/recv by size over group sizes 2 and
      4 (where the machine has the cores) on the backend a run would use (NCCL with GPUs, gloo
      without), with fork-started ranks -> alpha and bus bandwidth per op and group size (a
      least-squares line through time against bytes x the ring factor). Each sample is
      up to PIPELINED_CALLS calls (fewer for large messages, where the bytes dominate) and one
      barrier, each call after a layer's worth of small GEMMs on a CPU (_layer_work), less the same
      loop without the calls, per call: as a step's per-layer TP collectives run (a barrier per
      call would price each at a barrier's round trip on top; a tight loop of calls keeps the ranks
      in step, which a layer's compute between them does not);
  host overheads (CPU only): megafab's own train_step at world 1 on tiny GPTs (HOST_MODELS: 1 and
      3 layers, 1 and 2 micro-batches; DDP, distributed optimizer, FSDP2; and DDP with full
      recompute), its forward-backward and optimizer timed apart (megafab's level-1 timers); what
      the model's kernel times do not explain is fitted (fit_host_overheads) to a fixed cost per
      micro-batch and one per layer per micro-batch (forward-backward), one per parameter tensor
      (optimizer), a fixed cost per step (the rest of train_step) and one per recomputed layer per
      micro-batch. A GPU profile has none: the host runs ahead of the kernels there;
  busy slowdown (CPU only, measure_busy_slowdown): the host-overhead GPT's step with every core
      running a copy over its step alone (Machine.sharing scales a rank's compute and host work by
      it when the job's ranks keep the cores busy);
  in-step collective alphas (CPU only, step_calibration.py): megafab's own train_step at world 2
      and 4 under one layout per collective, each alpha fitted so the model gives the measured
      step ("n@world", "n@world:step" and "n@world:fsdp" entries beside the loop's "n"); the rows
      and their steps are kept in the profile (calibration_steps) for a later run to re-launch.
"""

from __future__ import annotations

import contextlib
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
    import torch

    if device.type != "cpu":
        return lambda: None
    a, b = torch.randn(128, 128), torch.randn(128, 128)

    def work():
        for _ in range(4):
            a @ b
    return work


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
    work = _layer_work(device)
    for size in MESSAGE_SIZES:
        elements = size // 4
        full = torch.ones(elements * world, device=device)
        shard = torch.ones(elements, device=device)
        calls = _calls(size)
        repeats = 5 if calls > 1 else 3
        loop = functools.partial(_pipelined, dist, None, full, shard, rank, world, calls, work)
        base = _timed(loop, repeats)
        for op in OPS + ("send_recv",):
            nbytes = 2 * elements * 4 if op == "send_recv" else elements * world * 4
            run = functools.partial(_pipelined, dist, op, full, shard, rank, world, calls, work)
            per_call = (_timed(run, repeats) - base) / calls
            out.setdefault(op, []).append((nbytes, max(per_call, MIN_CALL_S)))
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def _line(xs: list[float], ys: list[float], weights: list[float] | None = None) -> tuple[float, float]:
    """(intercept, slope) of the (weighted) least-squares line y = intercept + slope x."""
    w = weights or [1.0] * len(xs)
    total = sum(w)
    mx, my = sum(wi * x for wi, x in zip(w, xs)) / total, sum(wi * y for wi, y in zip(w, ys)) / total
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / max(
        sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs)), 1e-30)
    return my - slope * mx, slope


def _fit(points: list[tuple[float, float]], factor: float, steps: int) -> list[float]:
    """[alpha per step, bus bandwidth] of t = steps * alpha + factor * bytes / busbw, least squares
    of the relative error (weights 1/t^2): the small messages set alpha, the large ones busbw (plain
    least squares lets a large message's noise swamp the intercept)."""
    ys = [t for _, t in points]
    weights = [1 / (t + MIN_CALL_S) ** 2 for t in ys]
    intercept, slope = _line([factor * nbytes for nbytes, _ in points], ys, weights)
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
        alpha, busbw = _fit(points, factor, steps)
        if op == "send_recv":  # one transfer: alpha, link bandwidth
            fitted[op] = {"2": [alpha * 2 / 2, busbw]}
        else:
            fitted[op] = {str(n): [alpha, busbw]}
    return fitted


HOST_MODELS = ((1, 1), (3, 1), (1, 2), (3, 2))  # (layers, micro-batches) of the host-overhead GPTs
HOST_SHARDINGS = {"none": [], "distributed_optimizer": ["--use-distributed-optimizer"],
                  "fsdp2": ["--use-torch-fsdp2"]}
HOST_RECOMPUTE = {"none": [], "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                       "--recompute-num-layers", "1"],
                  "selective": ["--recompute-granularity", "selective"]}
HOST_RECOMPUTE_TERMS = {"full": "recomputed_layer_micro_batch_s",
                        "selective": "selective_layer_micro_batch_s"}
HOST_STEPS = 7


def _host_runs():
    """(sharding, recompute, layers, micro-batches) of each timed model: HOST_MODELS under every
    sharding, and the first two again with full and with selective recompute (DDP)."""
    runs = [(sharding, "none", *model) for sharding in HOST_SHARDINGS for model in HOST_MODELS]
    return runs + [("none", recompute, *model) for recompute in HOST_RECOMPUTE_TERMS
                   for model in HOST_MODELS[:2]]


HOST_SEQ, HOST_VOCAB = 16, 128


def host_flags(layers: int, micro_batches: int, sharding: str = "none", recompute: str = "none",
               heads: int = 2) -> list[str]:
    """Megatron flags of a GPT so small its step is nearly all host work (micro-batch 1; seq
    HOST_SEQ, vocab HOST_VOCAB)."""
    return HOST_SHARDINGS[sharding] + HOST_RECOMPUTE[recompute] + [
        "--num-layers", str(layers), "--hidden-size", "32", "--num-attention-heads", str(heads),
        "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "128", "--make-vocab-size-divisible-by", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "1",
        "--global-batch-size", str(micro_batches), "--train-iters", "1000", "--lr", "1e-4", "--mock-data"]


def host_batches():
    """host_flags' micro-batch (one fixed random sequence), repeated for ever."""
    import itertools

    import torch

    tokens = torch.randint(0, HOST_VOCAB, (1, HOST_SEQ + 1), generator=torch.Generator().manual_seed(0))
    return itertools.repeat({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                             "loss_mask": torch.ones(1, HOST_SEQ)})


@contextlib.contextmanager
def _world_one_group():
    """In a forked process: one thread, a gloo group of this process alone (its own file store)."""
    os.environ.update(OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="megafab-profile-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0,
                                world_size=1)
        yield
        dist.destroy_process_group()


def _host_rank(results, steps: int) -> None:
    """In a forked process: a world-1 gloo group, every run's model built, then their train_steps
    timed in rounds (one step of each per round)."""
    from megafab.arguments import config_from_args
    from megafab.timers import Timers
    from megafab.training.build import init_distributed
    from megafab.training.pretrain import setup
    from megafab.training.step import train_step

    with _world_one_group():
        data = host_batches()
        runs, topo = [], None
        for run in _host_runs():
            cfg = config_from_args(host_flags(*run[2:], *run[:2]), world_size=1)
            if topo is None:
                topo, tracker = init_distributed(cfg)
            state, timers = setup(cfg, topo, tracker), Timers(log_level=1)
            for _ in range(2):
                train_step(state, data, timers)
            runs.append((run, state, timers, []))
        for _ in range(steps):  # in rounds: a burst of load on a shared machine hits every model alike
            for _, state, timers, samples in runs:
                fb, opt = timers("forward-backward", 1), timers("optimizer", 1)
                before = fb.elapsed, opt.elapsed
                start = time.perf_counter()
                train_step(state, data, timers)
                samples.append((time.perf_counter() - start, fb.elapsed - before[0], opt.elapsed - before[1]))
        rows = [{"sharding": sharding, "recompute": recompute, "layers": layers,
                 "micro_batches": micro_batches, "param_tensors": len(state.optimizer.entries),
                 **{key: statistics.median(s[i] for s in samples)
                    for i, key in enumerate(("step_s", "forward_backward_s", "optimizer_s"))}}
                for (sharding, recompute, layers, micro_batches), state, _, samples in runs]
    results.put(rows)


def measure_host_steps(steps: int = HOST_STEPS) -> list[dict]:
    """HOST_MODELS' step, forward-backward and optimizer seconds under each of HOST_SHARDINGS: the
    median of HOST_STEPS steps each, as the layout benchmark and the calibration steps take a step
    (the least of them fitted terms 20-30% below the median steps of every layout here)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    proc = ctx.Process(target=_host_rank, args=(results, steps))
    proc.start()
    rows = results.get(timeout=120)
    proc.join(timeout=10)
    return rows


BUSY_PHASES, BUSY_PHASE_STEPS = 8, 4


def _busy_rank(results, barrier, index: int) -> None:
    """In a forked process: the host-overhead GPT at world 1, stepped in BUSY_PHASES pairs of
    phases: process 0 alone (the others wait), then every process at once; its step times in each."""
    from megafab.arguments import config_from_args
    from megafab.training.build import init_distributed
    from megafab.training.pretrain import setup
    from megafab.training.step import train_step

    def timed() -> list[float]:
        out = []
        for _ in range(BUSY_PHASE_STEPS):
            begin = time.perf_counter()
            train_step(state, data)
            out.append(time.perf_counter() - begin)
        return out

    with _world_one_group():
        cfg = config_from_args(host_flags(2, 4), world_size=1)
        state, data = setup(cfg, *init_distributed(cfg)), host_batches()
        for _ in range(2):
            train_step(state, data)
        alone, together = [], []
        for _ in range(BUSY_PHASES):
            barrier.wait()
            if index == 0:
                alone += timed()
            barrier.wait()
            together += timed()
    results.put((alone, together))


def measure_busy_slowdown(cores: int) -> float:
    """Machine.busy_slowdown: the host-overhead GPT's median step with `cores` copies running at
    once over its median step alone, the two alternated phase by phase in the same processes (so a
    burst of other work on a shared machine hits both alike); at least 1. Two independent
    processes on a 2-core VM ran 1.04-1.25x slower than one (shared caches and clocks), and every
    world-2 layout there measured ~0.85x its prediction without this term."""
    from megafab.run.fork_ranks import import_rank_modules

    if cores < 2:
        return 1.0
    import_rank_modules()
    ctx = mp.get_context("fork")
    results, barrier = ctx.Queue(), ctx.Barrier(cores)
    procs = [ctx.Process(target=_busy_rank, args=(results, barrier, i)) for i in range(cores)]
    for proc in procs:
        proc.start()
    steps = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=10)
    alone = [t for a, _ in steps for t in a]
    together = [t for _, b in steps for t in b]
    return max(1.0, statistics.median(together) / statistics.median(alone))


def with_kernel_times(rows: list[dict], machine: Machine) -> list[dict]:
    """Each row plus what the step-time model gives its kernels on `machine` (no host terms): one
    micro-batch's forward-backward (kernel_micro_batch_s) and the optimizer step (kernel_optimizer_s)."""
    from megafab.arguments import config_from_args
    from megafab.plan.planner import plan
    from megafab.plan.step_time import optimizer_seconds, stage_passes

    out = []
    for row in rows:
        flags = host_flags(row["layers"], row["micro_batches"], row["sharding"], row.get("recompute", "none"))
        cfg = config_from_args(flags, world_size=1)
        (fwd, bwd), = stage_passes(cfg, machine)
        out.append({**row, "kernel_micro_batch_s": fwd.total + bwd.total,
                    "kernel_optimizer_s": optimizer_seconds(cfg, machine, plan(cfg, "cpu"))})
    return out


def fit_host_overheads(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Machine.host_overheads from with_kernel_times' rows, per sharding, least squares:
    forward-backward / micro-batch - kernels = micro_batch_s + layers x layer_micro_batch_s;
    optimizer - kernels = the optimizer's fixed cost + tensors x param_tensor_s; step_s the rest of
    the step (median) plus the optimizer's fixed cost; the full- and selective-recompute rows
    (DDP's; every sharding gets those values) what is left of their forward-backward per
    recomputed layer (recomputed_layer_micro_batch_s: the checkpointed forward again, RNG states
    saved and restored; selective_layer_micro_batch_s: the checkpointed attention's). Negative
    fits (noise) are 0."""
    out = {}
    plain = [r for r in rows if r.get("recompute", "none") == "none"]

    def per_micro_batch(r):
        return r["forward_backward_s"] / r["micro_batches"] - r["kernel_micro_batch_s"]

    for sharding in dict.fromkeys(r["sharding"] for r in plain):
        mine = [r for r in plain if r["sharding"] == sharding]
        mb, layer = _line([r["layers"] for r in mine], [per_micro_batch(r) for r in mine])
        opt_fixed, tensor = _line([r["param_tensors"] for r in mine],
                                  [r["optimizer_s"] - r["kernel_optimizer_s"] for r in mine])
        rest = statistics.median(r["step_s"] - r["forward_backward_s"] - r["optimizer_s"] for r in mine)
        out[sharding] = {"step_s": max(rest + opt_fixed, 0.0), "micro_batch_s": max(mb, 0.0),
                         "layer_micro_batch_s": max(layer, 0.0), "param_tensor_s": max(tensor, 0.0)}
    ddp = out.get("none")
    for recompute, term in HOST_RECOMPUTE_TERMS.items():
        recomputed = [r for r in rows if r.get("recompute") == recompute]
        extra = 0.0
        if recomputed and ddp:
            left = [(r["layers"], per_micro_batch(r) - ddp["micro_batch_s"]
                     - r["layers"] * ddp["layer_micro_batch_s"]) for r in recomputed]
            extra = max(sum(n * y for n, y in left) / sum(n * n for n, _ in left), 0.0)
        for terms in out.values():
            terms[term] = extra
    return out


def measure(name: str = "this-machine", budget_s: float = 90.0) -> Machine:
    import torch

    from megafab.plan.step_calibration import fit_step_collectives, measure_calibration_steps

    device = _device()
    cores = os.cpu_count() or 1
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    sizes = [n for n in (2, 4) if (n <= gpus if gpus else n <= max(2, 2 * cores))]
    collectives: dict = {}
    for n in sizes:  # first: ranks are forked before this process starts any compute thread pool
        for op, table in measure_collectives(n).items():
            collectives.setdefault(op, {}).update(table)
    host_rows = measure_host_steps() if device.type == "cpu" else []
    busy = measure_busy_slowdown(cores) if device.type == "cpu" else 1.0
    step_rows = measure_calibration_steps(sizes) if device.type == "cpu" else []
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
    machine = Machine(
        name=name, peak_tflops=peaks, device_memory_gib=memory_gib, hbm_bandwidth=bandwidth,
        gpus_per_node=max(gpus, 1024), intra_busbw=ring[1], intra_latency_s=ring[0], nic_bandwidth=link[1],
        inter_latency_s=link[0], gemm_efficiency=1.0, kernel_overhead_s=0.0,
        attention_fwd_efficiency=att_f, attention_bwd_efficiency=att_b, attention_seq_half=0.0,
        hbm_efficiency=1.0, gemm_points=gemms, collectives=collectives, iteration_overhead_s=0.0,
        host_memory_gib=memory_gib, compute_slots=0 if gpus else cores, busy_slowdown=busy,
        source=f"measured by megafab-estimate --profile on {device.type}")
    if host_rows:
        machine.host_overheads = fit_host_overheads(with_kernel_times(host_rows, machine))
    fit_step_collectives(step_rows, machine)  # last: it prices the steps with everything above
    machine.calibration_steps = step_rows
    return machine
