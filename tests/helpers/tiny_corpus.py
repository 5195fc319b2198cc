"""Tiny .bin/.idx datasets and the tiny model flags the error catalogue runs pretrain_gpt.py with."""

from __future__ import annotations

import re

import numpy as np

from megafab.data.indexed_dataset import IndexedDatasetWriter
from tests.helpers.flags import tiny_flags

# NullTokenizer appends eod: --vocab-size 127 -> ids 0..127, padded to 128 at TP 1 and 2.
EOD = 127
TINY = tiny_flags(num_layers=2) + [
    "--micro-batch-size", "1", "--num-workers", "0", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "127", "--make-vocab-size-divisible-by", "32", "--lr", "1e-3", "--log-interval", "1",
    "--eval-interval", "1000", "--eval-iters", "1", "--distributed-timeout-minutes", "0.5"]
# One message: the error line, and for configuration errors the problems listed under it.
ERROR_LINE = re.compile(r"^megafab: error: .*(?:\n  - .*)*", re.M)


def write_corpus(prefix: str, num_docs: int = 300, max_id: int = 100, seed: int = 0,
                 bad_token: tuple[int, int] | None = None) -> str:
    """num_docs documents of 10-60 ids below max_id, each ending in eod; bad_token=(doc, id) puts
    one out-of-vocabulary id into document doc."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(prefix + ".bin", np.uint16)
    for d in range(num_docs):
        doc = list(rng.integers(0, max_id, size=int(rng.integers(10, 60)))) + [EOD]
        if bad_token is not None and d == bad_token[0]:
            doc[3] = bad_token[1]
        writer.add_document(doc)
    writer.finalize(prefix + ".idx")
    return prefix


def error_lines(result) -> list[str]:
    return [line for text in result.err + result.out for line in ERROR_LINE.findall(text)]


def assert_one_message(result, pattern: str, code: int = 2, ranks=None) -> str:
    """Exactly one `megafab: error:` line in the whole job, matching pattern; no traceback; every
    rank (or those in `ranks`) exited with `code`."""
    lines = error_lines(result)
    assert len(lines) == 1, f"{len(lines)} error lines:\n{result.describe()}"
    assert re.search(pattern, lines[0]), lines[0]
    everything = "".join(result.err + result.out)
    assert "Traceback" not in everything, result.describe()
    for rank in ranks if ranks is not None else range(len(result.codes)):
        assert result.codes[rank] == code, result.describe()
    return lines[0]
