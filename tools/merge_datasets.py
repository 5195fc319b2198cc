"""Shim for Megatron habits: `python tools/merge_datasets.py` runs megafab-merge
(megafab/cli/merge.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from megafab.cli.merge import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
