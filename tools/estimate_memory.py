"""Shim for Megatron habits: `python tools/estimate_memory.py` runs megafab-estimate
(megafab/cli/estimate.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from megafab.cli.estimate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
