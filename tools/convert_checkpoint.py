"""Shim for Megatron habits: `python tools/convert_checkpoint.py` runs megafab-convert
(megafab/cli/convert.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from megafab.cli.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
