"""Document readers for tools/preprocess_data.py: jsonl (.gz, .zst), parquet, HuggingFace save_to_disk.

find_inputs(pattern, keys, hf_split=None) -> list[InputSource], checked up front
read_records(source, keys) -> iterator of (number, row)               parquet and saved datasets
jsonl_lines(path) -> iterator of (number, line bytes, bytes read so far)  the fast path

A bad input fails before any output is written. Optional packages (pyarrow, datasets, zstandard)
are imported only when an input needs them; a missing one is a DataError naming the pip install.
"""

from __future__ import annotations

import glob
import gzip
import importlib
import io
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from megafab.data.errors import DataError

BATCH_ROWS = 1024


@dataclass(frozen=True)
class InputSource:
    path: str
    kind: str  # "jsonl" | "parquet" | "hf"


def require(module: str, purpose: str, package: str):
    """Import an optional module, or raise one DataError saying what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{purpose} needs the {package} package, which is not installed; "
                        f"pip install {package} (or pip install -e '.[data]')") from None


def find_inputs(pattern: str, keys: list[str], hf_split: str | None = None) -> list[InputSource]:
    """--input (a file, a glob, or a save_to_disk directory) as sources in sorted order, having
    checked that the packages each needs are installed and that parquet files and datasets have
    the `keys` columns."""
    paths = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
    if not paths or not os.path.exists(paths[0]):
        raise DataError(f"--input {pattern}: no such file")
    sources = [_source_for(path, keys, hf_split) for path in paths]
    if hf_split is not None and not any(s.kind == "hf" for s in sources):
        raise DataError(f"--hf-split {hf_split} applies only to a HuggingFace save_to_disk directory, "
                        f"and --input {pattern} has none; drop --hf-split")
    return sources


def _source_for(path: str, keys: list[str], hf_split: str | None) -> InputSource:
    if os.path.isdir(path):
        directory = _hf_dataset_dir(path, hf_split)
        _check_columns(directory, _load_hf(directory).column_names, keys)
        return InputSource(directory, "hf")
    if path.endswith(".parquet"):
        _check_columns(path, _open_parquet(path).schema_arrow.names, keys)
        return InputSource(path, "parquet")
    if path.endswith(".zst"):
        require("zstandard", f"--input {path} (zstd-compressed jsonl)", "zstandard")
    return InputSource(path, "jsonl")


def _hf_dataset_dir(path: str, hf_split: str | None) -> str:
    """The directory holding one saved Dataset: path itself, or the chosen split of a DatasetDict."""
    require("datasets", f"--input {path} (HuggingFace save_to_disk directory)", "datasets")
    if os.path.isfile(os.path.join(path, "state.json")):
        if hf_split is not None:
            raise DataError(f"--hf-split {hf_split}: {path} is a single saved Dataset, not a DatasetDict "
                            "with splits; drop --hf-split")
        return path
    dict_file = os.path.join(path, "dataset_dict.json")
    if not os.path.isfile(dict_file):
        raise DataError(f"--input {path}: a directory input must be a HuggingFace dataset saved with "
                        "save_to_disk (state.json or dataset_dict.json inside); for a folder of files "
                        f"pass a glob such as '{os.path.join(path, '*.jsonl')}'")
    with open(dict_file, encoding="utf-8") as f:
        splits = json.load(f).get("splits", [])
    if hf_split is None:
        if "train" not in splits:
            raise DataError(f"--input {path} is a DatasetDict with splits {', '.join(splits)} and no "
                            "'train'; choose one with --hf-split NAME")
        print(f"note: {path} is a DatasetDict with splits {', '.join(splits)}; reading 'train' "
              "(choose another with --hf-split NAME)", file=sys.stderr)
        hf_split = "train"
    if hf_split not in splits:
        raise DataError(f"--hf-split {hf_split}: {path} has splits {', '.join(splits)}; pick one of them")
    return os.path.join(path, hf_split)


def read_records(source: InputSource, keys: list[str]) -> Iterator[tuple[int, dict]]:
    """Rows of a parquet file or saved dataset, each a dict of the requested columns, number counting
    rows from 1; streamed in record batches, in stored order. jsonl goes through jsonl_lines."""
    if source.kind == "parquet":
        return _parquet_rows(source.path, keys)
    if source.kind == "hf":
        return _hf_rows(source.path, keys)
    raise ValueError(f"read_records reads parquet and saved datasets, not {source.kind}: use jsonl_lines")


def _open_binary(path: str):
    """(decompressed stream, raw file): .gz and .zst are decompressed on the fly."""
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    except OSError as e:
        raise DataError(f"--input {path}: cannot read ({e.strerror})") from None
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw), raw
    if path.endswith(".zst"):
        zstd = require("zstandard", f"--input {path} (zstd-compressed jsonl)", "zstandard")
        return zstd.ZstdDecompressor().stream_reader(raw, read_across_frames=True), raw
    return raw, raw


def jsonl_lines(path: str) -> Iterator[tuple[int, bytes, int]]:
    """(number, raw line, bytes of the file read so far): lines split on b"\\n" only, blank lines
    included (so line numbers and Megatron's per-line partitioning agree), decoded and parsed by the
    worker that tokenizes them."""
    stream, raw = _open_binary(path)
    errors: tuple[type[BaseException], ...] = (OSError, EOFError)
    if path.endswith(".zst"):
        errors += (importlib.import_module("zstandard").ZstdError,)
    try:
        reader = io.BufferedReader(stream, 1 << 20) if stream is not raw else raw
        for number, line in enumerate(reader, 1):
            yield number, line, raw.tell()
    except errors as e:
        raise DataError(f"--input {path}: cannot read ({e}); is the file complete?") from None
    finally:
        raw.close()


def _check_columns(path: str, columns: list[str], keys: list[str]) -> None:
    missing = [k for k in keys if k not in columns]
    if missing:
        raise DataError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(columns)}); "
                        "name the text columns with --json-keys")


def _open_parquet(path: str):
    pa = require("pyarrow", f"--input {path} (parquet)", "pyarrow")
    pq = require("pyarrow.parquet", f"--input {path} (parquet)", "pyarrow")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None


def _load_hf(path: str):
    """A save_to_disk Dataset, memory-mapped (nothing is read until rows are asked for)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets = require("datasets", f"--input {path} (HuggingFace save_to_disk directory)", "datasets")
    try:
        return datasets.load_from_disk(path)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a loadable save_to_disk dataset ({e})") from None


def _parquet_rows(path: str, keys: list[str]) -> Iterator[tuple[int, dict]]:
    with _open_parquet(path) as parquet:
        number = 0
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=keys):
            for record in batch.to_pylist():
                number += 1
                yield number, record


def _hf_rows(path: str, keys: list[str]) -> Iterator[tuple[int, dict]]:
    dataset = _load_hf(path)
    number = 0
    # Memory-mapped arrow shards, read BATCH_ROWS rows at a time in dataset order.
    for batch in dataset.select_columns(keys).iter(batch_size=BATCH_ROWS):
        for values in zip(*(batch[k] for k in keys)):
            number += 1
            yield number, dict(zip(keys, values))
