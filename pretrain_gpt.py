"""Pretrain a GPT with Megatron-style parallelism: parse -> initialize -> build -> train.

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ... (Megatron flags)
"""

import sys

from megafab.arguments import config_or_exit


def main(argv=None):
    cfg = config_or_exit(argv)
    if cfg.training.dry_run:  # the plan only: no process group, no tensors
        from megafab.training.planner import format_plan, plan

        print(format_plan(cfg, plan(cfg)))
        return 0
    from megafab.training.pretrain import pretrain

    return pretrain(cfg)


if __name__ == "__main__":
    sys.exit(main())
