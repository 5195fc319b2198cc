"""Helpers shared by the benchmark scripts: machine load, a one-process gloo group, megafab's
training state from Megatron flags, a fixed synthetic batch, table statistics, allocator peaks."""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megafab.arguments import config_from_args  # noqa: E402
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed  # noqa: E402
from megafab.distributed.topology import build_topology  # noqa: E402
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler  # noqa: E402


def load_average() -> str:
    """The 1/5/15-minute load averages, as `uptime` prints them."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def init_single_process() -> None:
    """A world of one gloo rank, so megafab's builders get real (trivial) groups."""
    if dist.is_initialized():
        return
    path = os.path.join(tempfile.mkdtemp(prefix="megafab_bench_"), "rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def model_size_args(ap, *, layers: int, hidden: int, heads: int, seq: int, vocab: int,
                    vocab_help: str | None = None) -> None:
    """The model-size flags the benchmarks share (--layers --hidden --heads --seq --vocab)."""
    for flag, default in (("--layers", layers), ("--hidden", hidden), ("--heads", heads), ("--seq", seq)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--vocab", type=int, default=vocab, help=vocab_help)


def gpt_flags(layers: int, hidden: int, heads: int, seq: int, batch: int, vocab: int) -> list[str]:
    """Megatron flags of a dropout-free GPT-2-style model (tied embeddings, LayerNorm, GELU)."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--vocab-size", str(vocab),
            "--make-vocab-size-divisible-by", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", str(batch), "--global-batch-size", str(batch), "--train-iters", "1000",
            "--lr", "1e-4", "--lr-decay-style", "constant", "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--mock-data"]


def build_state(flags: list[str], world_size: int = 1, topo=None) -> TrainState:
    """megafab's TrainState as pretrain_gpt.py builds it (process group must exist)."""
    cfg = config_from_args(flags, world_size=world_size)
    p = cfg.parallel
    if topo is None:
        topo = build_topology(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                              cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                              etp=p.expert_tensor_parallel_size)
    return state_of(cfg, topo)


def state_of(cfg, topo) -> TrainState:
    """The TrainState of a finalized config on `topo`: seeded RNG streams, model, optimizer, schedule."""
    tracker = RNGStatesTracker(topo.device)
    model_parallel_seed(cfg.training.seed, topo.tp_rank, topo.pp_rank, topo.device, tracker,
                        cp_rank=topo.cp_rank)
    model = build_model(cfg, topo, tracker)
    optimizer = build_optimizer(cfg, topo, model)
    return TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))


def synthetic_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(batch, seq)}


def repeat_batch(batch: dict):
    return itertools.repeat(batch)


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def fmt_spread(values: list[float], digits: int = 0) -> str:
    med, lo, hi = median_spread(values)
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def peak_cpu_bytes(fn) -> int:
    """Peak bytes allocated by fn above its starting point, from the profiler's allocator trace."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak
