"""Token ids outside the tokenizer's vocabulary, found before training reads them.

An id at or beyond the vocabulary either crashes the embedding lookup (past the padded size) or,
inside the padding, trains rows no tokenizer ever produces. Two checks, one rule:
  * at start-up, the largest and smallest id of each .bin, scanned once and cached under
    --data-cache-path (keyed by the file's path, size and mtime); without a cache directory only
    files up to SCAN_LIMIT_BYTES are scanned, at every start;
  * every sample, as it is read (a few comparisons over seq_length ids): the backstop for large
    uncached files and the mock dataset.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np

from megafab.data.errors import DataError
from megafab.data.index_cache import cached_arrays

SCAN_LIMIT_BYTES = 2 << 30
CHUNK_BYTES = 64 << 20  # a multiple of every dtype's size


def out_of_vocabulary(where: str, token: int, vocab_size: int, every_rank: bool = True) -> DataError:
    return DataError(f"{where} holds token id {token}, outside the tokenizer's vocabulary "
                     f"0..{vocab_size - 1}; the data was made with another tokenizer or --vocab-size: "
                     f"preprocess it again with this one, or train with the tokenizer it was made with",
                     every_rank=every_rank)


def check_sample(tokens: np.ndarray, vocab_size: int | None, where: Callable[[], str]) -> None:
    """Raise (on this rank only) if a sample's tokens leave the vocabulary."""
    if vocab_size is None or not len(tokens):
        return
    high, low = int(tokens.max()), int(tokens.min())
    if high >= vocab_size or low < 0:
        raise out_of_vocabulary(where(), high if high >= vocab_size else low, vocab_size, every_rank=False)


def _scan(bin_path: str, dtype) -> tuple[np.ndarray]:
    """(min, max) id of a .bin, read sequentially (no mmap: any file system, --no-mmap-bin-files)."""
    low, high = 0, -1
    with open(bin_path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            ids = np.frombuffer(chunk, dtype=dtype)
            low, high = min(low, int(ids.min())), max(high, int(ids.max()))
    return (np.array([low, high], dtype=np.int64),)


def check_dataset(dataset, vocab_size: int | None, cache_path: str | None = None,
                  barrier: Callable[[], None] | None = None, is_builder: bool = True) -> None:
    """Raise (on every rank alike) if the .bin of `dataset` holds ids outside the vocabulary."""
    if vocab_size is None:
        return
    path = dataset.bin_path
    size = os.path.getsize(path)
    if cache_path is None and size > SCAN_LIMIT_BYTES:
        return  # left to the per-sample check; --data-cache-path makes this a one-time scan
    description = json.dumps({"class": "TokenRange", "path": os.path.abspath(path), "size": size,
                              "mtime_ns": os.stat(path).st_mtime_ns, "dtype": np.dtype(dataset.dtype).name})
    (bounds,) = cached_arrays(cache_path, "TokenRange", description, ["bounds"],
                              lambda: _scan(path, dataset.dtype), barrier, is_builder)
    low, high = (int(x) for x in bounds)
    if high >= vocab_size or low < 0:
        raise out_of_vocabulary(path, high if high >= vocab_size else low, vocab_size)
