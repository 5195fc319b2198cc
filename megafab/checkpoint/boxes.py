"""Rectangular boxes of a tensor, and the few boxes that a flat range of a row-major tensor covers.

A flat range [lo, hi) of a C-contiguous tensor of shape (n0, n1, ..., nk) is

    a partial first row   (recursively: a flat range of one (n1, ..., nk) row)
    the full rows between (one box of shape (rows, n1, ..., nk))
    a partial last row    (recursively)

Each box is contiguous in the flat order, so a flat buffer that holds the range holds every box as a
plain view (`flat[start - lo : start - lo + numel].view(sizes)`), never a copy. A range yields at
most 2 * dims - 1 boxes; a range that starts and ends on row boundaries is one box.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """The block [offsets, offsets + sizes) of a tensor, one (start, size) per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def shifted(self, origin: tuple[int, ...]) -> Box:
        """The same box in a tensor where this one's tensor starts at `origin`."""
        return Box(tuple(o + d for o, d in zip(self.offsets, origin)), self.sizes)

def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[int, Box]]:
    """(flat start, box) of every box covering [lo, hi) of a row-major `shape`, in flat order."""
    shape = tuple(shape)
    assert 0 <= lo <= hi <= math.prod(shape), (shape, lo, hi)
    if lo == hi:
        return []
    if not shape:  # a 0-d tensor: its one element
        return [(0, Box((), ()))]
    return _boxes(shape, lo, hi)


def _boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[int, Box]]:
    if len(shape) == 1:
        return [(lo, Box((lo,), (hi - lo,)))]
    inner = shape[1:]
    row = math.prod(inner)
    first, lo_col = divmod(lo, row)
    last, hi_col = divmod(hi, row)

    def within_row(r: int, a: int, b: int) -> list[tuple[int, Box]]:
        return [(r * row + start, Box((r, *box.offsets), (1, *box.sizes)))
                for start, box in _boxes(inner, a, b)]

    if first == last:
        return within_row(first, lo_col, hi_col)
    out = []
    if lo_col:
        out += within_row(first, lo_col, row)
        first += 1
    if last > first:
        out.append((first * row, Box((first,) + (0,) * len(inner), (last - first, *inner))))
    if hi_col:
        out += within_row(last, 0, hi_col)
    return out
