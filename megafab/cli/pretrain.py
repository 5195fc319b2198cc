"""megafab-pretrain: train a GPT with Megatron-style parallelism: parse -> initialize -> build -> train.

    torchrun --nproc-per-node 8 --no-python megafab-pretrain --tensor-model-parallel-size 2 ...
    torchrun --nproc-per-node 8 -m megafab.cli.pretrain ...     (the same)
    torchrun --nproc-per-node 8 pretrain_gpt.py ...             (the repo's shim, as with Megatron)
"""

import sys

from megafab.arguments import config_or_exit
from megafab.run.report import exit_on_user_error


def machine_checks():
    """What the command line asks of this machine (TE, FP8, attention kernels), checked together
    with the flags so that one message lists every problem."""
    # deferred: importing the console script (its --help) stays free of torch and the model code
    from megafab.model.attention_backend import attention_backend_problems
    from megafab.model.te import transformer_engine_problems
    from megafab.run.packages import missing_package_problems
    from megafab.training.build import planned_device

    def dry_run_vocabulary(cfg):
        if cfg.training.dry_run and cfg.model.vocab_size is None and cfg.data.tokenizer_type is None:
            return ["--dry-run needs the vocabulary size: give --vocab-size or the tokenizer flags "
                    "(--tokenizer-type ...)"]
        return []

    return (lambda cfg: transformer_engine_problems(cfg.model, cfg.precision, planned_device(cfg)),
            lambda cfg: attention_backend_problems(cfg, planned_device(cfg)),
            dry_run_vocabulary, missing_package_problems)


def main(argv=None):
    with exit_on_user_error():
        cfg = config_or_exit(argv, checks=machine_checks(), start_up=True)
        if cfg.training.dry_run:  # the plan only: no process group, no tensors
            # deferred: the plan needs torch; a run that fails its checks never loads it
            from megafab.plan.planner import format_plan, plan
            from megafab.plan.report import dry_run_prediction

            for line in cfg.start_up_notes():
                print(f"megafab: note: {line}")
            stages = plan(cfg)
            print(format_plan(cfg, stages, step_time=dry_run_prediction(cfg, stages)))
            return 0
        # deferred: the training code loads only for a run that passed its checks
        from megafab.training.pretrain import pretrain

        return pretrain(cfg)


if __name__ == "__main__":
    sys.exit(main())
