"""megafab-preprocess: Megatron's tools/preprocess_data.py (jsonl, parquet, HF datasets -> .bin/.idx);
the implementation is megafab/data/preprocess/ (cli.py holds the flags)."""

import sys

from megafab.data.preprocess.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
