"""BlendedDataset: interleaves several datasets so that each contributes in proportion to its weight."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import numpy as np
import torch

from megafab.data.errors import DataError
from megafab.data.index_cache import cached_arrays


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy blending: sample k goes to the dataset with the largest weight * max(k, 1) - count.

    Returns dataset_index [size] int16 and dataset_sample_index [size] int64 (the k-th sample taken
    from that dataset). Ties go to the lowest dataset index. Each step depends on all previous ones,
    so this runs as a plain loop (about 0.5 s per million samples for two datasets).
    """
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    chosen = [0] * size
    taken = [0] * size
    others = range(1, len(weights))
    for k in range(size):
        kk = float(max(k, 1))
        best, best_error = 0, weights[0] * kk - counts[0]
        for i in others:
            error = weights[i] * kk - counts[i]
            if error > best_error:
                best, best_error = i, error
        chosen[k] = best
        taken[k] = counts[best]
        counts[best] += 1
    dataset_index = np.array(chosen, dtype=np.int16)
    dataset_sample_index = np.array(taken, dtype=np.int64)
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in proportion to `weights` (normalized here)."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int,
                 split_name: str, cache_path: str | None = None, barrier: Callable[[], None] | None = None,
                 is_builder: bool = True):
        if len(datasets) != len(weights) or not all(w > 0 for w in weights):
            raise DataError(f"blend weights {list(weights)} must be positive, one per dataset "
                            f"({len(datasets)} datasets)")
        total = float(np.sum(np.asarray(weights, dtype=np.float64)))
        self.weights = (np.asarray(weights, dtype=np.float64) / total).tolist()
        self.datasets = list(datasets)
        self.size = size
        description = json.dumps({
            "class": "BlendedDataset", "datasets": [getattr(d, "description", repr(d)) for d in datasets],
            "split": split_name, "weights": self.weights, "size": size}, indent=4)
        self.dataset_index, self.dataset_sample_index = cached_arrays(
            cache_path, f"BlendedDataset-{split_name}", description,
            ["dataset_index", "dataset_sample_index"],
            lambda: build_blending_indices(self.weights, size), barrier, is_builder)
        used = np.bincount(np.asarray(self.dataset_index, dtype=np.int64), minlength=len(datasets))
        for i, (n, dataset) in enumerate(zip(used, datasets)):
            if n > len(dataset):
                raise DataError(f"the {split_name} blend takes {n} samples from dataset {i} "
                                f"({getattr(dataset, 'dataset_path', '?')}) which has only {len(dataset)}; "
                                "raise that split's share or that dataset's sample count")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
