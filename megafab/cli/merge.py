"""Merge every .bin/.idx dataset in a directory (sorted by name) into one; all must share a dtype.

    megafab-merge --input data/parts --output-prefix data/all_text_document
    (also: python -m megafab.cli.merge, python tools/merge_datasets.py)
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from megafab.data.errors import DataError
from megafab.data.indexed_dataset import merge_datasets
from megafab.run.report import exit_status


def prefixes_in(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        raise DataError(f"--input {directory}: not a directory")
    prefixes = sorted(p[:-4] for p in glob.glob(os.path.join(directory, "*.idx")))
    if not prefixes:
        raise DataError(f"--input {directory}: no .idx files to merge")
    for prefix in prefixes:
        if not os.path.isfile(prefix + ".bin"):
            raise DataError(f"{prefix}.bin: missing (its .idx exists)")
    return prefixes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="directory holding PREFIX.bin/.idx pairs")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--multimodal", action="store_true")
    def body():
        args = parser.parse_args(argv)
        prefixes = prefixes_in(args.input)
        merge_datasets(prefixes, args.output_prefix, multimodal=args.multimodal)
        print(f"merged {len(prefixes)} datasets into {args.output_prefix}")

    return exit_status(body)


if __name__ == "__main__":
    sys.exit(main())
