"""Megatron's data-path and split strings, parsed strictly (config validation and the builder share
these rules, so a bad string is refused before any process group starts).

    --data-path P                      one dataset
    --data-path P1 P2 ...              a blend weighted by dataset size
    --data-path w1 P1 w2 P2 ...        a blend with explicit positive weights
    --split 969,30,1                   train/valid/test proportions (',' or '/' between them)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from megafab.data.errors import DataError


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(data_path: str | Sequence[str] | None) -> tuple[list[str], list[float] | None] | None:
    """`P` / `P1 P2 ...` (weights from sizes) / `w1 P1 w2 P2 ...` -> (prefixes, weights or None)."""
    if data_path is None:
        return None
    items = data_path.split() if isinstance(data_path, str) else [str(p).strip() for p in data_path]
    if not items:
        raise DataError("data path is empty; give a prefix such as my-corpus_text_document")
    shown = " ".join(items)
    if _number(items[0]) is None:
        numbers = [i for i in items if _number(i) is not None]
        if numbers:
            raise DataError(f"data path {shown!r}: {numbers[0]!r} reads as a weight, but the list does not "
                            f"start with one; give 'w1 PREFIX1 w2 PREFIX2 ...' or only prefixes")
        return items, None
    if len(items) % 2:
        raise DataError(f"data path {shown!r}: a weighted blend alternates weight and prefix "
                        f"('w1 PREFIX1 w2 PREFIX2 ...'), but it has {len(items)} items")
    weights, prefixes = items[0::2], items[1::2]
    for w in weights:
        value = _number(w)
        if value is None:
            raise DataError(f"data path {shown!r}: {w!r} stands where a weight belongs and is not a number; "
                            f"give 'w1 PREFIX1 w2 PREFIX2 ...'")
        if not (math.isfinite(value) and value > 0):
            raise DataError(f"data path {shown!r}: blend weight {w} must be a positive number")
    for p in prefixes:
        if _number(p) is not None:
            raise DataError(f"data path {shown!r}: {p!r} stands where a prefix belongs; give "
                            f"'w1 PREFIX1 w2 PREFIX2 ...'")
    return prefixes, [float(w) for w in weights]


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> normalized [train, valid, test] fractions (missing parts are 0)."""
    # Quotes a launch script kept (Megatron's own scripts write --split '99,1,0') are no error.
    parts = [p.strip() for p in re.split(r"[,/]", split.strip().strip("'\""))]
    values = [_number(p) for p in parts]
    if len(parts) > 3 or any(v is None or not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise DataError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum, "
                        "e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    array = np.asarray(values, dtype=np.float64)  # normalized as megatron-core does, bit for bit
    return (array / np.sum(array)).tolist()
