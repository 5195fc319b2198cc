"""Index arrays cached as .npy under a cache directory: one builder writes, every rank memory-maps."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import numpy as np


def description_hash(description: str) -> str:
    return hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()


def cached_arrays(cache_path: str | None, stem: str, description: str, names: list[str],
                  build: Callable[[], tuple[np.ndarray, ...]], barrier: Callable[[], None] | None = None,
                  is_builder: bool = True) -> tuple[np.ndarray, ...]:
    """Load arrays `{hash}-{stem}-{name}.npy` from cache_path, building them first when missing.

    Without cache_path every process builds in memory. With it, the process with is_builder=True
    builds and saves on a miss; barrier() (when given, called once by every process) makes the others
    wait for it before they memory-map the files.
    """
    if cache_path is None:
        arrays = build()
        if barrier is not None:
            barrier()
        return arrays
    base = os.path.join(cache_path, f"{description_hash(description)}-{stem}")
    paths = [f"{base}-{name}.npy" for name in names]
    if is_builder and not all(os.path.isfile(p) for p in paths):
        arrays = build()
        os.makedirs(cache_path, exist_ok=True)
        with open(f"{base}-description.txt", "w", encoding="utf-8") as f:
            f.write(description)
        for path, array in zip(paths, arrays):
            tmp = f"{path}.tmp{os.getpid()}.npy"
            np.save(tmp, array)
            os.replace(tmp, path)
    if barrier is not None:
        barrier()
    return tuple(np.load(p, mmap_mode="r") for p in paths)
