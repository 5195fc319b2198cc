"""Measured pipeline bubble per stage vs theory, and stage-0 peak memory with/without freeing
sent activations.

    python benchmarks/pipeline_bubble.py [--p 4] [--m 8] [--v 2] [--forward-ms 20]

Runs p gloo processes on CPU. Each micro-batch's compute is a sleep (forward t, backward 2t per
rank, split evenly over the v chunks), so compute dominates communication and the idle time left
is the schedule's bubble. Per stage, over one schedule call (after a warm-up call):
    wall   = from a barrier until every stage has returned (the step ends when the pipe drains)
    idle   = time blocked in p2p exchanges + in the final drain barrier (measured directly)
    sleep  = the compute stand-in alone; wall - idle - sleep is the toy's real math, autograd
             and Python per step, which grows with the number of steps (v times more with v chunks)
    bubble = idle / (wall - idle)   (Megatron's definition; theory (p-1)/m, interleaved (p-1)/(v*m))
    idle%  = idle / wall            (theory (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1))

Memory: the CPU allocator trace of torch.profiler (profile_memory=True) on stage 0, peak bytes
above the start of the schedule call, with deallocate_pipeline_outputs on and off.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_util import peak_cpu_bytes  # noqa: E402
from benchmarks.pipeline_toy import (  # noqa: E402
    build_chunks,
    forward_step,
    full_weights,
    make_batches,
)
from megafab.distributed import p2p  # noqa: E402
from megafab.distributed.pipeline import get_forward_backward_func  # noqa: E402
from megafab.distributed.topology import build_topology  # noqa: E402
from megafab.run.fork_ranks import run_ranks  # noqa: E402

VOCAB = 32


class Busy:
    """Sleeps standing in for compute, and the time they took."""

    def __init__(self):
        self.seconds = 0.0

    def work(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.seconds += time.perf_counter() - start


class SleepInBackward(torch.autograd.Function):
    """Identity whose backward spends `seconds` of 'compute'."""

    @staticmethod
    def forward(ctx, x, busy, seconds):
        ctx.busy, ctx.seconds = busy, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.busy.work(ctx.seconds)
        return grad, None, None


def _bubble_rank(rank, world, p, v, m, forward_s):
    topo = build_topology(tp=1, pp=p, vpp=v)
    layers, seq, mbs, hidden = p * v, 8, 2, 16
    chunks = build_chunks(full_weights(VOCAB, hidden, layers), layers, p, v, topo.pp_rank)
    batches = make_batches(m, seq, mbs, VOCAB)
    busy = Busy()
    chunk_forward_s = forward_s / v

    def timed_step(data_iterator, model):
        busy.work(chunk_forward_s)
        output, loss_func = forward_step(data_iterator, model)
        return SleepInBackward.apply(output, busy, 2 * chunk_forward_s), loss_func

    schedule = get_forward_backward_func(p, v)
    kwargs = dict(forward_step_func=timed_step, num_microbatches=m, seq_length=seq, micro_batch_size=mbs,
                  hidden_size=hidden, topology=topo, dtype=torch.float64)
    blocked = Busy()
    exchange = p2p.P2PCommunicator.exchange

    def timed_exchange(self, *args, **kw):  # instrumentation only: time spent waiting on neighbours
        start = time.perf_counter()
        try:
            return exchange(self, *args, **kw)
        finally:
            blocked.seconds += time.perf_counter() - start

    p2p.P2PCommunicator.exchange = timed_exchange
    for _ in range(2):  # the first call warms up, the second is measured
        busy.seconds = blocked.seconds = 0.0
        for c in chunks:
            c.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        schedule(data_iterator=[iter(batches) for _ in chunks] if v > 1 else iter(batches),
                 model=chunks if v > 1 else chunks[0], **kwargs)
        drain = time.perf_counter()
        dist.barrier()
        end = time.perf_counter()
    return end - start, blocked.seconds + end - drain, busy.seconds


def _memory_rank(rank, world, p, v, m, seq, mbs, hidden, deallocate):
    topo = build_topology(tp=1, pp=p, vpp=v)
    layers = p * v
    chunks = build_chunks(full_weights(VOCAB, hidden, layers), layers, p, v, topo.pp_rank)
    for c in chunks:  # float32 keeps the numbers familiar
        c.float()
    batches = make_batches(m, seq, mbs, VOCAB)
    schedule = get_forward_backward_func(p, v)

    def run():
        schedule(forward_step_func=forward_step,
                 data_iterator=[iter(batches) for _ in chunks] if v > 1 else iter(batches),
                 model=chunks if v > 1 else chunks[0], num_microbatches=m, seq_length=seq,
                 micro_batch_size=mbs, hidden_size=hidden, topology=topo, dtype=torch.float32,
                 deallocate_pipeline_outputs=deallocate)

    run()  # grads allocated once, so the measured call sees only activations
    dist.barrier()
    if topo.pp_rank != 0:
        run()
        return 0
    return peak_cpu_bytes(run)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--v", type=int, default=2)
    ap.add_argument("--forward-ms", type=float, default=20.0)
    args = ap.parse_args(argv)
    p, m = args.p, args.m

    print(f"Bubble, p={p} m={m}, forward {args.forward_ms:.0f} ms + backward {2 * args.forward_ms:.0f} ms "
          f"per micro-batch per rank (sleep), gloo on CPU")
    print(f"{'schedule':<14}{'stage':>6}{'wall s':>9}{'idle s':>9}{'sleep s':>9}{'bubble':>9}{'theory':>9}"
          f"{'idle%':>8}{'theory%':>9}")
    for v in (1, args.v):
        name = "1F1B" if v == 1 else f"interleaved{v}"
        results = run_ranks(_bubble_rank, p, p, v, m, args.forward_ms / 1000, timeout=300)
        theory = (p - 1) / (v * m)
        theory_idle = (p - 1) / (v * m + p - 1)
        for stage, (wall, idle, sleep) in enumerate(results):
            print(f"{name:<14}{stage:>6}{wall:>9.3f}{idle:>9.3f}{sleep:>9.3f}{idle / (wall - idle):>9.3f}"
                  f"{theory:>9.3f}{100 * idle / wall:>7.1f}%{100 * theory_idle:>8.1f}%")

    seq, mbs, hidden = 64, 4, 256
    act_kib = seq * mbs * hidden * 4 / 1024
    print(f"\nStage-0 peak CPU memory of one schedule call, p={p} m={m}, activation [s, b, h] = "
          f"[{seq}, {mbs}, {hidden}] float32 = {act_kib:.0f} KiB")
    print(f"{'schedule':<14}{'freed':>12}{'kept':>12}{'saved':>12}{'saved/act':>11}")
    for v in (1, args.v):
        name = "1F1B" if v == 1 else f"interleaved{v}"
        peaks = [run_ranks(_memory_rank, p, p, v, m, seq, mbs, hidden, dealloc, timeout=300)[0]
                 for dealloc in (True, False)]
        saved = peaks[1] - peaks[0]
        print(f"{name:<14}{peaks[0] / 1024:>9.0f}KiB{peaks[1] / 1024:>9.0f}KiB{saved / 1024:>9.0f}KiB"
              f"{saved / 1024 / act_kib:>11.2f}")


if __name__ == "__main__":
    main()
