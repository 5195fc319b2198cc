"""Memory per rank at DP 1/2/4, with/without the distributed optimizer, and with full recompute at
DP 2, measured next to the planner's prediction (megafab.plan.planner.plan(cfg, kernels="cpu")).

    python benchmarks/memory.py [--layers 4 --hidden 256 --heads 8 --seq 256 --batch 4 --vocab 8192]

DP gloo processes on CPU, fp32 (or --bf16), dropout off. On rank 0, after one warm-up step:
    weights / grads / optimizer   measure_memory: distinct storages of params, DDP grad buffer,
                                  main params + Adam state
    saved act.                    bytes autograd keeps for backward during one micro-batch forward
                                  (torch.autograd.graph.saved_tensors_hooks, params excluded)
    step peak                     peak bytes allocated above the start of one train_step, from the
                                  CPU allocator trace of torch.profiler (activations, recompute's
                                  transient layer, logits, grad temporaries, optimizer scratch)
The planner columns are its weights+grads+optimizer and its activation peak for the same config.

--checkpoint adds the checkpoint rows of benchmarks/checkpoint_memory.py for the same model (peak
resident memory per rank of DP 4 runs that save every iteration or load and continue, against no
checkpoints; save time per rank at DP 1/2/4); benchmarks/README.md records them at 54M parameters.

--peaks: each rank's resident-set high-water mark (VmHWM) of FSDP2 and of the distributed optimizer
at DP 8 (8 gloo processes, fp32, default 12 layers x hidden 768, vocab 8192: 91.5M parameters), per
phase (build = model + optimizer; a few train steps; a checkpoint save; a resume: the state freed,
built again and the checkpoint loaded into it), minus the same phase of a tiny model's run (2
layers x hidden 64): the memory the model costs. Next to the bound of issue 26 (the sharded state,
16/8 bytes/param for FSDP2 and 8 + 12/8 for the distributed optimizer, plus four layers' fp32
parameters, +10%) and the planner's per-rank total (megafab.plan.planner, kernels="cpu").

--sharding adds the ZeRO-3 and offload rows (bf16 model, one step, rank 0): weights + grads +
optimizer bytes per parameter per rank with FSDP2 at DP 1/2/4 next to ZeRO-3's 16/d and the
planner's, and with optimizer CPU offload (FSDP2, distributed optimizer) the device-side and host
bytes per parameter next to the planner's (megafab.plan.state_memory).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import weakref

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_util import (  # noqa: E402
    build_state,
    gpt_flags,
    load_average,
    model_size_args,
    peak_cpu_bytes,
    repeat_batch,
    synthetic_batch,
)
from megafab.optim.memory import SavedActivations, measure_memory  # noqa: E402
from megafab.plan.planner import plan  # noqa: E402
from megafab.run.fork_ranks import run_ranks  # noqa: E402
from megafab.training.step import gpt_forward_step, train_step  # noqa: E402

FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
DIST_OPT = ["--use-distributed-optimizer"]
VARIANTS = [  # (name, data-parallel size, extra flags)
    ("DP1", 1, []), ("DP1 dist-opt", 1, DIST_OPT),
    ("DP2", 2, []), ("DP2 dist-opt", 2, DIST_OPT),
    ("DP4", 4, []), ("DP4 dist-opt", 4, DIST_OPT),
    ("DP2 recompute", 2, FULL_RECOMPUTE), ("DP2 dist-opt recompute", 2, DIST_OPT + FULL_RECOMPUTE),
]


def saved_bytes(state, data) -> int:
    """Bytes of distinct storages autograd saves in one micro-batch forward (parameters excluded)."""
    chunk = state.model[0]
    topo = state.topology
    with SavedActivations(chunk.parameters()) as saved:
        output, loss_func = gpt_forward_step(data, chunk, cp_group=topo.group("cp") if topo.cp > 1 else None)
        loss, _ = loss_func(output)
    loss.backward()
    chunk.zero_grad_buffer()
    return saved.bytes


def _measure_rank(rank, world, flags):
    state = build_state(flags, world_size=world)
    cfg = state.cfg
    data = repeat_batch(synthetic_batch(cfg.training.micro_batch_size, cfg.model.seq_length,
                                        cfg.model.vocab_size))
    train_step(state, data)  # Adam state and grad buffers exist from here on
    report = measure_memory(state.model, state.optimizer)
    saved = saved_bytes(state, data)
    peak = peak_cpu_bytes(lambda: train_step(state, data))
    return report.weights_bytes, report.grads_bytes, report.optimizer_bytes, saved, peak, report.num_params


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_size_args(ap, layers=4, hidden=256, heads=8, seq=256, vocab=8192)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch size per DP rank")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--checkpoint", action="store_true", help="also the checkpoint save/load rows")
    ap.add_argument("--sharding", action="store_true", help="only the ZeRO-3 (FSDP2) and offload rows")
    ap.add_argument("--peaks", action="store_true",
                    help="only the DP 8 peak-RSS rows (FSDP2, distributed optimizer); give the model "
                         "size flags for another model than 12 x 768")
    ap.add_argument("--steps", type=int, default=2, help="train steps in --peaks")
    ap.add_argument("--world", type=int, default=8, help="DP size (processes) in --peaks")
    ap.add_argument("--engines", nargs="+", choices=list(PEAK_ENGINES), default=list(PEAK_ENGINES),
                    help="the --peaks rows to run")
    args = ap.parse_args(argv)
    if args.peaks:
        size = ["--layers", "--hidden", "--heads", "--seq", "--vocab"]
        given = any(a.split("=")[0] in size for a in (argv if argv is not None else sys.argv[1:]))
        shape = (args.layers, args.hidden, args.heads, args.seq, args.vocab) if given else PEAK_SHAPE
        fixed_malloc_threshold()
        peak_rows(shape, args.steps, args.timeout, args.world, args.engines)
        return
    base = gpt_flags(args.layers, args.hidden, args.heads, args.seq, args.batch, args.vocab)
    base += ["--bf16"] if args.bf16 else []
    if args.sharding:
        sharding_rows(base, args.timeout)
        return

    mib = 1024 * 1024
    print(f"Memory per rank (rank 0), {'bf16' if args.bf16 else 'fp32'}: layers {args.layers}, "
          f"hidden {args.hidden}, heads {args.heads}, seq {args.seq}, micro-batch {args.batch}, vocab "
          f"{args.vocab}; MiB; {load_average()}")
    print(f"{'variant':<24}{'weights':>9}{'grads':>9}{'optim':>9}{'state':>9}{'plan state':>12}{'B/param':>9}"
          f"{'saved act':>11}{'step peak':>11}{'plan act':>10}")
    from megafab.arguments import config_from_args

    for name, dp, extra in VARIANTS:
        flags = base + extra
        flags[flags.index("--global-batch-size") + 1] = str(dp * args.batch)
        row = run_ranks(_measure_rank, dp, flags, timeout=args.timeout)[0]
        weights, grads, optim, saved, peak, params = row
        stage = plan(config_from_args(flags, world_size=dp), kernels="cpu")[0]
        print(f"{name:<24}{weights / mib:>9.2f}{grads / mib:>9.2f}{optim / mib:>9.2f}"
              f"{(weights + grads + optim) / mib:>9.2f}{stage.state_bytes / mib:>12.2f}"
              f"{(weights + grads + optim) / params:>9.2f}"
              f"{saved / mib:>11.2f}{peak / mib:>11.2f}{stage.activation_peak_bytes / mib:>10.2f}",
              flush=True)
    print(f"after: {load_average()}")
    if args.checkpoint:
        from benchmarks import checkpoint_memory

        checkpoint_memory.main(["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads",
                                str(args.heads), "--seq", str(args.seq), "--vocab", str(args.vocab)])


SHARDING = {  # name: (DP size, flags, ZeRO-3's bytes per parameter per rank or None)
    "FSDP2 DP1": (1, ["--use-torch-fsdp2"], 16.0),
    "FSDP2 DP2": (2, ["--use-torch-fsdp2"], 16.0 / 2),
    "FSDP2 DP4": (4, ["--use-torch-fsdp2"], 16.0 / 4),
    "FSDP2 DP2 offload": (2, ["--use-torch-fsdp2", "--optimizer-cpu-offload"], None),
    "FSDP2 DP2 offload 0.5": (2, ["--use-torch-fsdp2", "--optimizer-cpu-offload",
                                  "--optimizer-offload-fraction", "0.5"], None),
    "DP2 dist-opt offload": (2, ["--use-distributed-optimizer", "--optimizer-cpu-offload"], None),
}


def _measure_state(rank, world, flags):
    state = build_state(flags, world_size=world)
    cfg = state.cfg
    data = repeat_batch(synthetic_batch(cfg.training.micro_batch_size, cfg.model.seq_length,
                                        cfg.model.vocab_size))
    train_step(state, data)
    report = measure_memory(state.model, state.optimizer)
    return report.num_params, report.total_bytes, report.host_bytes


def sharding_rows(base: list[str], timeout: float) -> None:
    """The ZeRO-3 / offload table (see the module docstring); `base`: the model flags."""
    from megafab.arguments import config_from_args

    base = base + ([] if "--bf16" in base else ["--bf16"])
    print(f"ZeRO-3 (FSDP2) and optimizer offload, bf16, bytes per parameter on rank 0; {load_average()}")
    print(f"{'variant':<24}{'device':>9}{'plan':>9}{'ratio':>8}{'16/d':>8}{'host':>9}{'plan':>9}")
    for name, (dp, extra, zero3) in SHARDING.items():
        flags = base + extra
        micro_batch = int(flags[flags.index("--micro-batch-size") + 1])
        flags[flags.index("--global-batch-size") + 1] = str(dp * micro_batch)
        params, device, host = run_ranks(_measure_state, dp, flags, timeout=timeout)[0]
        stage = plan(config_from_args(flags, world_size=dp))[0]
        planned_device, planned_host = stage.state_bytes / stage.params, stage.host_bytes / stage.params
        measured = device / params
        print(f"{name:<24}{measured:>9.3f}{planned_device:>9.3f}{measured / planned_device:>8.3f}"
              f"{'' if zero3 is None else f'{zero3:.3f}':>8}{host / params:>9.3f}{planned_host:>9.3f}")
    print(f"after: {load_average()}")


PEAK_SHAPE = (12, 768, 12, 64, 8192)  # layers, hidden, heads, seq, vocab: 91.5M parameters
TINY_SHAPE = (2, 64, 4, 64, 128)
PEAK_ENGINES = {  # name: (flags, state bytes per parameter per rank at DP 8 for the bound)
    "FSDP2": (["--use-torch-fsdp2"], 16 / 8),
    "dist-opt": (["--use-distributed-optimizer"], 8 + 12 / 8),
}
PHASES = ("build", "steps", "save", "load")


MALLOC_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def fixed_malloc_threshold() -> None:
    """Re-run this script with glibc's mmap threshold fixed at 64 KiB, so every tensor buffer of
    64 KiB or more is its own mapping, returned to the system when freed: the resident set then
    follows the bytes alive. By default glibc raises the threshold to the largest block freed so
    far (up to 32 MiB) and keeps later blocks in its heap, whose resident size stays at its own
    high-water mark (measured: +45 MiB at DP 2 of a 3.4M-parameter model)."""
    if any(os.environ.get(k) != v for k, v in MALLOC_THRESHOLD.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **MALLOC_THRESHOLD})


def _resident_peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _reset_resident_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current resident size


def _phase_peaks(rank, world, flags, steps):
    """VmHWM (KiB) of each phase of one rank: build, steps, checkpoint save, and a resume (build
    again and load that checkpoint)."""
    from megafab.checkpoint.checkpointing import load_checkpoint, save_checkpoint

    peaks = {}
    _reset_resident_peak()
    state = build_state(flags, world_size=world)
    peaks["build"] = _resident_peak_kib()
    cfg = state.cfg
    data = repeat_batch(synthetic_batch(cfg.training.micro_batch_size, cfg.model.seq_length,
                                        cfg.model.vocab_size))
    _reset_resident_peak()
    for _ in range(steps):
        train_step(state, data)
    peaks["steps"] = _resident_peak_kib()
    _reset_resident_peak()
    save_checkpoint(state)
    peaks["save"] = _resident_peak_kib()
    # a resume: a fresh build (no optimizer state yet) that loads the checkpoint, after the first
    # state is really gone (a leaked one would be counted in the load row)
    model = weakref.ref(state.model[0])
    del state
    gc.collect()
    if model() is not None:
        raise RuntimeError("the dropped training state is still alive: the resume would hold two")
    _reset_resident_peak()
    load_checkpoint(build_state(flags, world_size=world))
    peaks["load"] = _resident_peak_kib()
    return peaks


def _peak_flags(shape, world: int, extra: list[str], save_dir: str) -> list[str]:
    layers, hidden, heads, seq, vocab = shape
    flags = gpt_flags(layers, hidden, heads, seq, 1, vocab) + extra + ["--save", save_dir, "--load", save_dir]
    flags[flags.index("--global-batch-size") + 1] = str(world)
    return flags


def peak_rows(shape, steps: int, timeout: float, world: int, engines: list[str]) -> None:
    """The --peaks table (see the module docstring)."""
    import tempfile

    from megafab.arguments import config_from_args
    from megafab.plan.planner import layer_params

    mib = 2.0**20
    print(f"Peak resident memory per rank above a tiny model's, DP {world} (gloo), fp32, layers "
          f"{shape[0]}, hidden {shape[1]}, heads {shape[2]}, seq {shape[3]}, vocab {shape[4]}, "
          f"micro-batch 1, {steps} steps; MiB; {load_average()}")
    print(f"{'engine':<10}" + "".join(f"{p:>8}" for p in PHASES) + f"{'max':>8}{'rank':>6}{'bound':>8}"
          f"{'planner':>9}{'ratio':>7}  planner's peak")
    for name in engines:
        extra, per_param = PEAK_ENGINES[name]
        rows = {}
        for which, size in (("tiny", TINY_SHAPE), ("model", shape)):
            with tempfile.TemporaryDirectory(prefix="megafab-peaks-") as save_dir:
                flags = _peak_flags(size, world, extra, save_dir)
                rows[which] = run_ranks(_phase_peaks, world, flags, steps, timeout=timeout)
        above = [{p: (big[p] - small[p]) * 1024 / mib for p in PHASES}
                 for big, small in zip(rows["model"], rows["tiny"])]
        worst = max(range(world), key=lambda r: max(above[r].values()))
        cfg = config_from_args(_peak_flags(shape, world, extra, "/unused"), world_size=world)
        stage = plan(cfg, kernels="cpu")[0]
        params = stage.params
        bound = 1.1 * (per_param * params + 4 * 4 * layer_params(cfg.model, 1)) / mib
        measured, planned = max(above[worst].values()), stage.total_bytes / mib
        print(f"{name:<10}" + "".join(f"{above[worst][p]:>8.0f}" for p in PHASES) + f"{measured:>8.0f}"
              f"{worst:>6}{bound:>8.0f}{planned:>9.0f}{planned / measured:>7.2f}  {stage.peak_phase}",
              flush=True)
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
