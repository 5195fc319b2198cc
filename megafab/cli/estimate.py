"""Memory, step time and the fastest layout for Megatron flags, without starting any process.

    megafab-estimate --num-gpus 8 --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
        --seq-length 2048 --vocab-size 50304 --micro-batch-size 4 --global-batch-size 64 --bf16 \
        --use-distributed-optimizer --gpu h100-sxm-80gb

    megafab-estimate <model and batch flags> --num-gpus 1024 --gpu h100-sxm-80gb --search --top 10
    megafab-estimate --profile machine.json        (measure this machine; then --machine machine.json)

MoE models (--num-experts): the plan prints total and active parameters and the expert grid, counts
expert state per EP x ETP rank over expert-DP, and --search also ranks EP and ETP.

Memory: megafab/plan/planner.py. Step time: megafab/plan/step_time.py. Search: megafab/plan/search.py.
--profile: megafab/calibrate/.
Also: python -m megafab.cli.estimate, python tools/estimate_memory.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megafab.arguments import config_or_exit
from megafab.config import ConfigError
from megafab.plan.machines import BUILTIN, MachineError, machine
from megafab.plan.planner import ROUTING, format_plan, plan
from megafab.plan.report import HEADER, candidate_row, prediction_line
from megafab.plan.search import candidate_from_flags, search
from megafab.run.report import exit_on_user_error


def own_parser() -> argparse.ArgumentParser:
    own = argparse.ArgumentParser(
        prog="megafab-estimate", add_help=False, allow_abbrev=False,
        usage="%(prog)s [flags below] [megafab-pretrain flags ...]", description=__doc__,
        epilog="Every megafab-pretrain flag is accepted too (megafab-pretrain --help lists them).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--world-size", "--num-gpus", dest="world_size", type=int, default=1,
                     help="devices (processes) of the planned job")
    own.add_argument("--gpu", choices=sorted(BUILTIN), help="predict the step time on this built-in machine")
    own.add_argument("--machine", metavar="FILE", help="predict on the machine profile in FILE (--profile)")
    own.add_argument("--search", action="store_true",
                     help="rank every valid layout that fits by predicted step time "
                          "(needs --gpu or --machine)")
    own.add_argument("--top", type=int, default=10, help="layouts --search prints")
    own.add_argument("--json", metavar="FILE",
                     help="write the evaluated layout and the search's candidates here")
    own.add_argument("--tp-comm-overlap", action="store_true",
                     help="assume Transformer Engine's TP communication overlap "
                          "(Megatron's --tp-comm-overlap)")
    own.add_argument("--profile", metavar="OUT", help="measure this machine into the profile OUT and exit")
    own.add_argument("--profile-seconds", type=float, default=90.0, help="time budget of --profile")
    own.add_argument("--gpu-memory-gb", type=float, help="flag stages that would not fit in this much")
    own.add_argument("--mfu", type=float, default=0.4, help="assumed MFU without --gpu/--machine")
    own.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU dense bf16 peak, with --mfu")
    own.add_argument("--moe-routing", choices=ROUTING, default="bound",
                     help="MoE: the routed rows the activation memory counts: their bound (the capacity, "
                          "or every token of the EP x ETP group without --moe-expert-capacity-factor) or "
                          "balanced (the expected count, which dropless routing can exceed)")
    own.add_argument("--attention-kernels", choices=["flash", "unfused", "cpu"], default="flash",
                     help="the attention kernels whose activation memory to count")
    return own


def split_args(argv):
    return own_parser().parse_known_args(argv)


def _evaluated(own, megatron_argv, target):
    """The layout the flags give, or None where it is not valid for this many devices."""
    try:
        return candidate_from_flags(megatron_argv, own.world_size, target, own.tp_comm_overlap,
                                    own.attention_kernels, own.moe_routing)
    except ConfigError:
        return None


def _run_search(own, megatron_argv, target) -> int:
    result = search(megatron_argv, own.world_size, target, top=own.top, tp_comm_overlap=own.tp_comm_overlap,
                    kernels=own.attention_kernels, routing=own.moe_routing)
    evaluated = _evaluated(own, megatron_argv, target)
    print(f"megafab-estimate --search: {own.world_size} devices of {target.name}: "
          f"{result.considered} configs built, {result.valid} valid, {result.fitting} fit in "
          f"{target.device_memory_gib:.1f} GiB; "
          f"{len(result.ranked)} best layouts in {result.seconds:.1f} s")
    print(HEADER)
    for i, cand in enumerate(result.ranked, 1):
        print(candidate_row(i, cand))
    if evaluated is not None:
        print(candidate_row("given", evaluated))
    if own.json:
        with open(own.json, "w") as f:
            json.dump({"machine": target.name, "num_gpus": own.world_size,
                       "candidates": [c.to_json() for c in result.ranked],
                       "evaluated": evaluated.to_json() if evaluated else None,
                       "search": {"considered": result.considered, "valid": result.valid,
                                  "fitting": result.fitting, "seconds": result.seconds}}, f, indent=1)
    return 0 if result.ranked else 2


def _check_writable(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise MachineError(f"--profile {path}: cannot write a file there (its folder {folder} must "
                           "exist and be writable); give another path")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        own_parser().print_help()
        return 0
    own, megatron_argv = split_args(argv)
    if own.profile:
        # deferred: measuring imports torch and the training stack, which --help and estimates skip
        from megafab.calibrate.profile import measure

        with exit_on_user_error():
            _check_writable(own.profile)  # before the minute of measuring
        measure(f"profile {own.profile}", budget_s=own.profile_seconds).save(own.profile)
        print(f"megafab-estimate: wrote the profile of this machine to {own.profile}; "
              f"use --machine {own.profile}")
        return 0
    with exit_on_user_error():
        target = machine(own.gpu, own.machine) if (own.gpu or own.machine) else None
        if own.search:
            if target is None:
                raise MachineError("--search needs a machine to predict on: add --gpu NAME (one of "
                                   f"{', '.join(BUILTIN)}) or --machine FILE (from --profile)")
            return _run_search(own, megatron_argv, target)
    if "--dry-run" not in megatron_argv:
        megatron_argv.append("--dry-run")  # training-only requirements (--lr, --train-iters, data) off
    cfg = config_or_exit(megatron_argv, world_size=own.world_size)
    stages = plan(cfg, own.attention_kernels, own.moe_routing)
    memory_limit = own.gpu_memory_gb or (target.device_memory_gib if target else None)
    print(format_plan(cfg, stages, mfu=own.mfu, peak_tflops=own.peak_tflops, gpu_memory_gb=memory_limit))
    if target is not None:
        cand = candidate_from_flags(megatron_argv, own.world_size, target, own.tp_comm_overlap,
                                    own.attention_kernels, own.moe_routing)
        print(prediction_line(cand.prediction, target))
        if own.json:
            with open(own.json, "w") as f:
                json.dump({"machine": target.name, "num_gpus": own.world_size, "candidates": [],
                           "evaluated": cand.to_json()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
