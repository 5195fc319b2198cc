"""Megatron's entry point name for megafab-pretrain (megafab/cli/pretrain.py):

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ... (Megatron flags)
"""

import sys

from megafab.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
