"""Exact and near-duplicate removal, decided in input order: the first copy is kept.

A document is an exact duplicate when its cleaned text equals that of an earlier kept document
(16-byte BLAKE2b digests), and a near duplicate when it shares a MinHash LSH bucket (rensa's
RMinHashLSH, 128 permutations split into `bands` bands) with an earlier kept document. The LSH bands
are chosen from the Jaccard threshold: the band count b (rows r = 128 / b) whose S-curve midpoint
(1/b)^(1/r) is nearest the threshold.

Only fingerprints reach this object (16 bytes and one signature per document), so one process
decides for the whole corpus whether the fingerprints were computed by local workers or by a Ray
cluster; that is what keeps the two pipelines byte-identical. Memory: ~16 bytes per kept document
for exact digests, ~b x 8 bytes for the LSH buckets.
"""

from __future__ import annotations

from megafab.data.errors import DataError
from megafab.data.preprocess.cleaning import NUM_PERM

BAND_CHOICES = tuple(b for b in range(2, NUM_PERM + 1) if NUM_PERM % b == 0)


def bands_for(threshold: float) -> int:
    if not 0.0 < threshold < 1.0:
        raise DataError(f"--near-dedup {threshold}: the Jaccard threshold must be between 0 and 1 (e.g. 0.7)")
    return min(BAND_CHOICES, key=lambda b: abs((1.0 / b) ** (b / NUM_PERM) - threshold))


class Deduplicator:
    def __init__(self, exact: bool, near_threshold: float | None):
        self.exact = set() if exact else None
        self.lsh = None
        if near_threshold is not None:
            from rensa import RMinHashLSH

            self.bands = bands_for(near_threshold)
            self.lsh = RMinHashLSH(threshold=near_threshold, num_perm=NUM_PERM, num_bands=self.bands)
        self._next_key = 0

    def check(self, digest: bytes | None, signature) -> str | None:
        """'duplicate', 'near_duplicate', or None (kept: remembered for the documents after it)."""
        if self.exact is not None:
            if digest in self.exact:
                return "duplicate"
        if self.lsh is not None:
            if self.lsh.query(signature):
                return "near_duplicate"
            self.lsh.insert(self._next_key, signature)
            self._next_key += 1
        if self.exact is not None:
            self.exact.add(digest)
        return None
