"""Shim for Megatron habits: `python tools/generate.py` runs megafab-generate
(megafab/cli/generate.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from megafab.cli.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
