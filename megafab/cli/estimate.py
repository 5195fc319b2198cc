"""Per-stage memory and FLOPs plan for Megatron flags, without starting any process.

    megafab-estimate --world-size 8 --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
        --seq-length 2048 --vocab-size 50304 --micro-batch-size 4 --global-batch-size 64 --bf16 \
        --use-distributed-optimizer --gpu-memory-gb 80

Formulas: megafab/training/planner.py. Also: python -m megafab.cli.estimate, python tools/estimate_memory.py.
"""

from __future__ import annotations

import argparse
import sys

from megafab.arguments import config_or_exit
from megafab.training.planner import format_plan, plan


def own_parser() -> argparse.ArgumentParser:
    own = argparse.ArgumentParser(
        prog="megafab-estimate", add_help=False, allow_abbrev=False,
        usage="%(prog)s [flags below] [megafab-pretrain flags ...]", description=__doc__,
        epilog="Every megafab-pretrain flag is accepted too (megafab-pretrain --help lists them).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--world-size", type=int, default=1, help="processes of the planned job")
    own.add_argument("--gpu-memory-gb", type=float, help="flag stages that would not fit in this much")
    own.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilization")
    own.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU dense bf16 peak")
    own.add_argument("--attention-kernels", choices=["flash", "unfused", "cpu"], default="flash",
                     help="the attention kernels whose activation memory to count")
    return own


def split_args(argv):
    return own_parser().parse_known_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        own_parser().print_help()
        return 0
    own, megatron_argv = split_args(argv)
    if "--dry-run" not in megatron_argv:
        megatron_argv.append("--dry-run")  # training-only requirements (--lr, --train-iters, data) off
    cfg = config_or_exit(megatron_argv, world_size=own.world_size)
    print(format_plan(cfg, plan(cfg, own.attention_kernels), mfu=own.mfu, peak_tflops=own.peak_tflops,
                      gpu_memory_gb=own.gpu_memory_gb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
