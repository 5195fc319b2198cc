"""Mixture of experts on this machine: an 8-experts top-2 GPT against the dense GPT with the same
active FLOPs, expert parallelism's efficiency, and the expert bytes each rank holds.

    python benchmarks/moe.py [--layers 2 --hidden 256 --heads 4 --seq 256 --batch 4 --vocab 1024
                              --experts 8 --topk 2 --steps 2 --rounds 5] [--parts speed,ep,memory]

Every run goes through megafab's build_model / build_optimizer / train_step (fp32, GPT-2 style,
AdamW, one fixed synthetic batch per micro-batch). Every layer is an MoE layer (Megatron's
--moe-layer-freq 1) with --moe-aux-loss-coeff 1e-2 as Mixtral's script; each expert's ffn width is
F (--expert-ffn, default 2 h) and the dense model's is 2 F, so top-2 routing gives both the same
MLP FLOPs per token (the router's 2 h E per token aside, < 1% here).

speed (one process, --threads threads): tokens/s of train_step for the dense model, the MoE model
with one GEMM per expert (SequentialMLP) and with --moe-grouped-gemm (torch's grouped matmul),
interleaved per round (dense, MoE, MoE grouped, dense, ...); "vs dense" is the median of per-round
ratios of the dense model's tokens/s to this one's (1.3 is issue 23's target), in wall-clock and
in process CPU time (less sensitive to other processes' load on a shared machine). Then the MoE
layer's parts, each timed alone on the layer's real modules at the step's shape (forward +
backward, process CPU time per call, median of interleaved rounds): the router (gate GEMM, top-k,
softmax, aux loss), dispatch + combine with identity experts (permutation and unpermutation; at
EP 1 no collectives), the experts' GEMMs (and activation, probability scaling), the whole MoE MLP,
and the dense MLP.

ep (two gloo processes, one thread each, as scaling.py): EP 2 with each dispatcher, and DP 2 with
the experts replicated (EP 1), against one process with two threads, same global batch (2
accumulated micro-batches of b/2):

    efficiency = (1 process, 2 threads step time) / (2 processes x 1 thread step time)
    vs 1t/2    = (1 process, 1 thread step time) / (2 x 2 processes x 1 thread step time)

(the second against a perfect 2x of one thread, not against intra-op threading).

memory (rank 0 after one step): bytes of the routed experts' weights, grads (their slice of DDP's
buffer) and optimizer state (Adam's, and masters if any) at EP 1/2/4 (world = EP: each rank holds
E/EP whole experts) and at world 4 with the distributed optimizer (which shards expert state over
expert-DP = world/EP), next to the planner's (megafab.plan.state_memory's rows for the
planner's expert parameter count, as planner.plan adds them) and to EP 1's total / EP; and the
rank's resident-set high-water mark (VmHWM) of build + step above its resident size before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_util import (  # noqa: E402
    fmt_spread,
    gpt_flags,
    init_single_process,
    load_average,
    model_size_args,
    repeat_batch,
    state_of,
    synthetic_batch,
)
from benchmarks.memory import _reset_resident_peak, _resident_peak_kib  # noqa: E402
from megafab.arguments import config_from_args  # noqa: E402
from megafab.distributed.data_parallel import is_expert_param  # noqa: E402
from megafab.distributed.topology import build_topology  # noqa: E402
from megafab.plan.moe import expert_data_parallel_size  # noqa: E402
from megafab.plan.planner import largest_fsdp_unit, stage_param_split  # noqa: E402
from megafab.plan.state_memory import state_bytes  # noqa: E402
from megafab.run.fork_ranks import run_ranks  # noqa: E402
from megafab.training.step import train_step  # noqa: E402

DIST_OPT = ["--use-distributed-optimizer"]
MEMORY_VARIANTS = [  # (name, world size, EP, extra flags)
    ("EP1", 1, 1, []), ("EP2", 2, 2, []), ("EP4", 4, 4, []),
    ("EP1 dist-opt w4", 4, 1, DIST_OPT), ("EP2 dist-opt w4", 4, 2, DIST_OPT),
    ("EP4 dist-opt w4", 4, 4, DIST_OPT),
]
EP_LAYOUTS = {  # --layouts key: (name, EP, dispatcher)
    "dp2": ("DP2 EP1", 1, "alltoall"), "allgather": ("EP2 allgather", 2, "allgather"),
    "alltoall": ("EP2 alltoall", 2, "alltoall"),
}


# ---- flags and state ----------------------------------------------------------------------------
def model_flags(args, *, moe: bool, mbs: int, gbs: int, ep: int = 1, dispatcher: str = "alltoall",
                grouped: bool = False) -> list[str]:
    """Megatron flags of the dense model (ffn 2 F) or the MoE model (E experts of width F, top-k)."""
    flags = gpt_flags(args.layers, args.hidden, args.heads, args.seq, mbs, args.vocab)
    flags[flags.index("--global-batch-size") + 1] = str(gbs)
    flags += ["--ffn-hidden-size", str(2 * args.expert_ffn)]
    if moe:
        flags += ["--num-experts", str(args.experts), "--moe-router-topk", str(args.topk),
                  "--moe-ffn-hidden-size", str(args.expert_ffn), "--moe-aux-loss-coeff", "1e-2",
                  "--moe-token-dispatcher-type", dispatcher, "--expert-model-parallel-size", str(ep)]
        flags += ["--moe-grouped-gemm"] if grouped else []
    return flags


def build(flags: list[str], world_size: int = 1):
    """megafab's TrainState for `flags` on the running process group, EP from the flags."""
    cfg = config_from_args(flags, world_size=world_size)
    return state_of(cfg, build_topology(1, 1, ep=cfg.parallel.expert_model_parallel_size))


def data_of(state, seed: int = 0):
    m, t = state.cfg.model, state.cfg.training
    return repeat_batch(synthetic_batch(t.micro_batch_size, m.seq_length, m.vocab_size, seed))


def mlp_of(state, layer: int = 0):
    return dict(state.model[0].named_modules())[f"module.decoder.layers.{layer}.mlp"]


# ---- speed: one process -------------------------------------------------------------------------
def timed_steps(state, data, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per step."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        train_step(state, data)
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def speed_rows(args) -> None:
    torch.set_num_threads(args.threads)
    init_single_process()
    b = args.batch
    variants = {"dense": model_flags(args, moe=False, mbs=b, gbs=b),
                "MoE": model_flags(args, moe=True, mbs=b, gbs=b),
                "MoE grouped": model_flags(args, moe=True, mbs=b, gbs=b, grouped=True)}
    states = {name: build(flags) for name, flags in variants.items()}
    data = {name: data_of(state) for name, state in states.items()}
    for name, state in states.items():
        for _ in range(args.warmup):
            train_step(state, data[name])
    tokens = b * args.seq
    wall = {name: [] for name in states}
    cpu = {name: [] for name in states}
    for _ in range(args.rounds):
        for name, state in states.items():
            w, c = timed_steps(state, data[name], args.steps)
            wall[name].append(w)
            cpu[name].append(c)
    print(f"MoE vs dense, one process x {args.threads} thread(s), fp32: layers {args.layers}, hidden "
          f"{args.hidden}, heads {args.heads}, seq {args.seq}, batch {b}, vocab {args.vocab}; "
          f"{args.experts} experts top-{args.topk} of ffn {args.expert_ffn} vs dense ffn "
          f"{2 * args.expert_ffn}; "
          f"{args.steps} steps x {args.rounds} rounds; {load_average()}")
    print(f"{'model':<14}{'tokens/s wall':>22}{'vs dense wall':>22}{'tokens/s CPU':>22}{'vs dense CPU':>22}")
    for name in states:
        ratio_wall = [m / d for m, d in zip(wall[name], wall["dense"])]
        ratio_cpu = [m / d for m, d in zip(cpu[name], cpu["dense"])]
        print(f"{name:<14}{fmt_spread([tokens / s for s in wall[name]]):>22}{fmt_spread(ratio_wall, 2):>22}"
              f"{fmt_spread([tokens / s for s in cpu[name]]):>22}{fmt_spread(ratio_cpu, 2):>22}")
        if name != "dense":
            print(f"{'':<14}per round vs dense (CPU): {' '.join(f'{r:.2f}' for r in ratio_cpu)}")
    part_rows(args, states)


def _cpu_ms(fn, reps: int) -> float:
    start = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - start) / reps * 1e3


def layer_parts(mlp, x: torch.Tensor) -> dict:
    """{part: a function running its forward + backward once} for one MoE MLP at input x [s, b, h]."""
    x = x.detach().requires_grad_()
    flat = x.detach().reshape(-1, x.shape[-1]).requires_grad_()
    with torch.no_grad():
        probs, routing_map = mlp.router(x)
        rows, per_expert, row_probs, _ = mlp.dispatcher.dispatch(flat, probs, routing_map)
    grad_out, grad_probs = torch.randn_like(x), torch.randn_like(probs)
    grad_rows = torch.randn_like(rows)
    rows, row_probs = rows.requires_grad_(), row_probs.requires_grad_()

    def router():
        out, _ = mlp.router(x)
        out.backward(grad_probs)

    def dispatch_combine():
        r, _, _, state = mlp.dispatcher.dispatch(flat, probs, routing_map)
        mlp.dispatcher.combine(r, state).backward(grad_out.view(flat.shape))

    def experts():
        mlp.experts(rows, per_expert, row_probs).backward(grad_rows)

    def whole():
        out, _ = mlp(x)
        out.backward(grad_out)

    return {"router": router, "dispatch + combine": dispatch_combine, "experts": experts, "MoE MLP": whole}


def part_rows(args, states) -> None:
    x = torch.randn(args.seq, args.batch, args.hidden)
    dense_mlp = mlp_of(states["dense"])
    grad = torch.randn_like(x)
    x_dense = x.clone().requires_grad_()

    def dense():
        dense_mlp(x_dense).backward(grad)

    parts = {"dense MLP": dense}
    for name in ("MoE", "MoE grouped"):
        parts.update({f"{name}: {k}": fn for k, fn in layer_parts(mlp_of(states[name]), x).items()})
    for fn in parts.values():
        fn()
    times = {name: [] for name in parts}
    for _ in range(args.rounds):
        for name, fn in parts.items():
            times[name].append(_cpu_ms(fn, args.part_reps))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"MoE layer parts, forward + backward of one layer's MLP on {args.seq * args.batch} tokens, "
          f"CPU ms per call, {args.part_reps} calls x {args.rounds} rounds; {load_average()}")
    print(f"{'part':<34}{'CPU ms':>22}{'of MoE MLP':>12}{'vs dense MLP':>14}")
    for name, t in times.items():
        whole = med[f"{name.split(':')[0]}: MoE MLP"] if ":" in name else med[name]
        print(f"{name:<34}{fmt_spread(t, 2):>22}{med[name] / whole:>12.2f}"
              f"{med[name] / med['dense MLP']:>14.2f}")
    for name in ("MoE", "MoE grouped"):
        overhead = med[f"{name}: router"] + med[f"{name}: dispatch + combine"]
        rest = med[f"{name}: MoE MLP"] - overhead - med[f"{name}: experts"]
        whole = med[f"{name}: MoE MLP"]
        print(f"{name}: router + dispatch/combine {overhead:.2f} ms = {overhead / whole:.2f} of "
              f"the MoE MLP; experts / dense MLP {med[f'{name}: experts'] / med['dense MLP']:.2f}; "
              f"MoE MLP - parts {rest:.2f} ms")


# ---- ep: two processes vs one with two threads ---------------------------------------------------
def _step_seconds(rank, world, flags, threads, warmup, steps):
    torch.set_num_threads(threads)
    state = build(flags, world)
    data = data_of(state, seed=rank)
    for _ in range(warmup):
        train_step(state, data)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        train_step(state, data)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def ep_rows(args) -> None:
    b = args.batch
    if b % 2:
        raise SystemExit(f"--batch {b} must be even (2 ranks x b/2)")
    print(f"EP 2 efficiency, fp32, 2 gloo processes x 1 thread vs 1 process x 2 threads: layers "
          f"{args.layers}, hidden {args.hidden}, seq {args.seq}, global batch {b} (micro-batch {b // 2}), "
          f"{args.experts} experts top-{args.topk}; {args.steps} steps x {args.rounds} rounds; "
          f"{load_average()}")
    print(f"{'layout':<16}{'1p x 1t s/step':>24}{'1p x 2t s/step':>24}{'2p x 1t s/step':>24}"
          f"{'efficiency':>20}{'vs 1t/2':>20}")
    ref_flags = model_flags(args, moe=True, mbs=b // 2, gbs=b)
    layouts = {name: model_flags(args, moe=True, mbs=b // 2, gbs=b, ep=ep, dispatcher=d)
               for name, ep, d in (EP_LAYOUTS[key] for key in args.layouts.split(","))}
    one_thread, two_threads, timed = [], [], {name: [] for name in layouts}
    run = dict(timeout=args.timeout)
    for _ in range(args.rounds):
        two_threads.append(run_ranks(_step_seconds, 1, ref_flags, 2, args.warmup, args.steps, **run)[0])
        for name, flags in layouts.items():
            timed[name].append(max(run_ranks(_step_seconds, 2, flags, 1, args.warmup, args.steps, **run)))
        one_thread.append(run_ranks(_step_seconds, 1, ref_flags, 1, args.warmup, args.steps, **run)[0])
    for name, seconds in timed.items():
        efficiency = [r / t for r, t in zip(two_threads, seconds)]
        vs_one_thread = [r / (2 * t) for r, t in zip(one_thread, seconds)]
        print(f"{name:<16} {fmt_spread(one_thread, 3):>23} {fmt_spread(two_threads, 3):>23}"
              f" {fmt_spread(seconds, 3):>23} {fmt_spread(efficiency, 2):>19}"
              f" {fmt_spread(vs_one_thread, 2):>19}")  # a space apart even where a value is wide
        print(f"{'':<16}per round: efficiency {' '.join(f'{e:.2f}' for e in efficiency)}; "
              f"vs 1t/2 {' '.join(f'{e:.2f}' for e in vs_one_thread)}")
    print(f"after: {load_average()}")


# ---- memory: expert bytes per rank --------------------------------------------------------------
def expert_state_bytes(state) -> tuple[int, int, int, int]:
    """(parameters, weights, grads, optimizer) bytes of this rank's routed-expert params: their
    tensors, their slices of the grad buffer, the masters and torch optimizer state of their
    entries (shards under the distributed optimizer)."""
    params = [p for chunk in state.model for p in chunk.parameters() if is_expert_param(p)]
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = 0
    for p in params:
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        grads += 0 if g is None else g.numel() * g.element_size()
    optimizer = 0
    opt = state.optimizer
    for entry in opt.entries:
        if not is_expert_param(entry.model_param):
            continue
        optimizer += entry.main.numel() * entry.main.element_size() if entry.is_copy else 0
        per_param = opt.torch_optimizer_of(entry).state.get(entry.main, {})
        optimizer += sum(v.numel() * v.element_size() for v in per_param.values() if torch.is_tensor(v))
    return sum(p.numel() for p in params), weights, grads, optimizer


def _resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _measure_experts(rank, world, flags):
    torch.set_num_threads(1)
    before = _resident_kib()
    _reset_resident_peak()
    state = build(flags, world)
    train_step(state, data_of(state, seed=rank))
    return (*expert_state_bytes(state), (_resident_peak_kib() - before) * 1024)


def planned_expert_bytes(cfg) -> tuple[int, int, int, int]:
    """(parameters, weights, grads, optimizer) of the routed experts on rank 0, as the planner
    counts them (stage_state_bytes's expert part)."""
    _, experts = stage_param_split(cfg, 0)
    _, unit = largest_fsdp_unit(cfg, 0)
    s = state_bytes(cfg, experts, unit, group_size=expert_data_parallel_size(cfg))
    return experts, int(s.weights), int(s.grads), int(s.optimizer)


def memory_rows(args) -> None:
    mib = 1024 * 1024
    print(f"Expert bytes per rank (rank 0 after one step), fp32: layers {args.layers}, hidden {args.hidden}, "
          f"{args.experts} experts of ffn {args.expert_ffn}; MiB; {load_average()}")
    print(f"{'variant':<18}{'edp':>4}{'experts':>8}{'weights':>9}{'grads':>9}{'optim':>9}{'total':>9}"
          f"{'plan':>9}{'meas/plan':>10}{'EP1/EP':>9}{'RSS peak':>10}")
    ep1_total = None
    worlds = {int(w) for w in args.memory_worlds.split(",")}
    for name, world, ep, extra in (v for v in MEMORY_VARIANTS if v[1] in worlds):
        flags = model_flags(args, moe=True, mbs=1, gbs=world, ep=ep) + extra
        row = run_ranks(_measure_experts, world, flags, timeout=args.timeout)[0]
        params, weights, grads, optim, rss = row
        cfg = config_from_args(flags, world_size=world)
        planned_params, *planned = planned_expert_bytes(cfg)
        assert planned_params == params, (name, params, planned_params)
        total = weights + grads + optim
        ep1_total = total if ep1_total is None else ep1_total
        print(f"{name:<18}{expert_data_parallel_size(cfg):>4}{args.experts // ep:>8}{weights / mib:>9.2f}"
              f"{grads / mib:>9.2f}{optim / mib:>9.2f}{total / mib:>9.2f}{sum(planned) / mib:>9.2f}"
              f"{total / sum(planned):>10.3f}{ep1_total / ep / mib:>9.2f}{rss / mib:>10.1f}", flush=True)
    print(f"after: {load_average()}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_size_args(ap, layers=2, hidden=256, heads=4, seq=256, vocab=1024)
    ap.add_argument("--batch", type=int, default=4, help="global batch (even)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=None, help="each expert's ffn width F (default 2 h)")
    ap.add_argument("--threads", type=int, default=1, help="threads of the one-process speed rows")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--part-reps", type=int, default=3, help="calls per round of each MoE layer part")
    ap.add_argument("--parts", default="speed,ep,memory")
    ap.add_argument("--layouts", default=",".join(EP_LAYOUTS), help="the ep rows: " + ", ".join(EP_LAYOUTS))
    ap.add_argument("--memory-worlds", default="1,2,4", help="the memory rows of these world sizes")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    args.expert_ffn = args.expert_ffn or 2 * args.hidden
    parts = args.parts.split(",")
    if "memory" in parts:  # forks first, before this process has a gloo group of its own
        memory_rows(args)
    if "ep" in parts:
        ep_rows(args)
    if "speed" in parts:
        speed_rows(args)


if __name__ == "__main__":
    main()
