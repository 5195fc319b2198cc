"""Synthetic documents for --mock-data runs: no files needed (same lengths and tokens as megatron-core)."""

from __future__ import annotations

import numpy as np


class MockIndexedDataset:
    """100,000 documents with lengths in [1, 4096); document i is 1, 2, ... (mod vocab) then eod."""

    seed = 0
    size = 100_000
    max_sequence_length = 4096

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size = vocab_size
        self.eod = eod
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size,
                                             dtype=np.int32)
        self.path_prefix = None

    def __len__(self) -> int:
        return self.size

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        n = int(self.sequence_lengths[idx])
        doc = np.concatenate([(np.arange(n - 1, dtype=np.int64) + 1) % self.vocab_size, [self.eod]])
        if length is None:
            length = n - offset
        return doc[offset:offset + length]
