"""Host (Python) work on a CPU, which the kernels' times leave out (a GPU's host runs ahead of its
kernels: a GPU profile has none of this).

host overheads: megafab's own train_step at world 1 on tiny GPTs (HOST_MODELS: 1 and 3 layers, 1
    and 2 micro-batches; DDP, distributed optimizer, FSDP2; and DDP with full and with selective
    recompute), its forward-backward and optimizer timed apart (megafab's level-1 timers); what the
    step-time model's kernel times do not explain is fitted (fit_host_overheads) to a fixed cost per
    micro-batch and one per layer per micro-batch (forward-backward), one per parameter tensor
    (optimizer), a fixed cost per step (the rest of train_step) and one per recomputed layer per
    micro-batch (Machine.host_overheads; megafab.plan.host_terms prices them).
busy slowdown (measure_busy_slowdown): the host-overhead GPT's step with every core running a copy
    over its step alone (host_terms.sharing scales a rank's compute and host work by it when the
    job's ranks keep the cores busy).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from megafab.arguments import config_from_args
from megafab.calibrate.stats import line
from megafab.plan.machines import Machine
from megafab.plan.planner import plan
from megafab.plan.step_time import optimizer_seconds, stage_passes
from megafab.run.fork_ranks import import_rank_modules
from megafab.timers import Timers
from megafab.training.build import init_distributed
from megafab.training.pretrain import setup
from megafab.training.step import train_step

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
    tokens = torch.randint(0, HOST_VOCAB, (1, HOST_SEQ + 1), generator=torch.Generator().manual_seed(0))
    return itertools.repeat({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                             "loss_mask": torch.ones(1, HOST_SEQ)})


@contextlib.contextmanager
def _world_one_group():
    """In a forked process: one thread, a gloo group of this process alone (its own file store)."""
    os.environ.update(OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="megafab-profile-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0,
                                world_size=1)
        yield
        dist.destroy_process_group()


def _host_rank(results, steps: int) -> None:
    """In a forked process: a world-1 gloo group, every run's model built, then their train_steps
    timed in rounds (one step of each per round)."""
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
        mb, layer = line([r["layers"] for r in mine], [per_micro_batch(r) for r in mine])
        opt_fixed, tensor = line([r["param_tensors"] for r in mine],
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
