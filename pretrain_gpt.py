"""Pretrain a GPT with Megatron-style parallelism: parse -> initialize -> build -> train.

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ... (Megatron flags)
"""

import sys

from megafab.arguments import config_from_args
from megafab.errors import MegafabError, exit_on_user_error


def main(argv=None):
    with exit_on_user_error():
        cfg = config_from_args(argv)
        if cfg.training.dry_run:  # the plan only: no process group, no tensors
            from megafab.training.planner import format_plan, plan

            if cfg.model.padded_vocab_size is None:
                if cfg.data.tokenizer_type is None:
                    raise MegafabError("--dry-run needs the vocabulary size: give --vocab-size or the "
                                       "tokenizer flags (--tokenizer-type ...)")
                from megafab.training.data_setup import attach_tokenizer

                attach_tokenizer(cfg)

            print(format_plan(cfg, plan(cfg)))
            return 0
        from megafab.training.pretrain import pretrain

        return pretrain(cfg)


if __name__ == "__main__":
    sys.exit(main())
