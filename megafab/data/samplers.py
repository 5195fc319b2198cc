"""Megatron's pretraining sampler and the micro-batch iterator built on it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megafab.data.errors import DataError


class MegatronPretrainingSampler:
    """Yields this DP rank's micro-batch of sample indices, global batch after global batch.

    Indices run consecutively from consumed_samples: each step of micro_batch_size * dp_size indices
    is cut into dp_size slices and rank r takes slice r. Resuming with the consumed_samples saved in a
    checkpoint continues exactly where the run stopped. A trailing partial step is dropped unless
    drop_last=False.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise DataError(f"total_samples {total_samples}: the dataset is empty; give more data or a "
                            "smaller sequence length")
        if not 0 <= consumed_samples < total_samples:
            raise DataError(f"consumed_samples {consumed_samples} must be in [0, {total_samples}); the run "
                            "has used up its data: raise the sample count or the train iterations")
        if micro_batch_size <= 0:
            raise DataError(f"micro_batch_size {micro_batch_size} must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise DataError(f"data_parallel_rank {data_parallel_rank} must be in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.data_parallel_size
        start = self.data_parallel_rank * self.micro_batch_size
        first = self.consumed_samples
        while first + step <= self.total_samples:
            yield list(range(first + start, first + start + self.micro_batch_size))
            first += step
        if first < self.total_samples and not self.drop_last:
            yield list(range(first, self.total_samples))[start:start + self.micro_batch_size]


def build_data_iterator(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                        num_workers: int = 0) -> Iterator[dict[str, torch.Tensor]] | None:
    """Iterator of collated micro-batches (dict of [b, ...] tensors) for this DP rank, or None."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         pin_memory=False, persistent_workers=num_workers > 0)
    return _CleanDataErrors(iter(loader)) if num_workers > 0 else iter(loader)


class _CleanDataErrors:
    """A DataLoader iterator whose workers' DataErrors come back as raised: the loader re-raises
    them built from a text that holds the worker's whole traceback. Other attributes: the loader
    iterator's."""

    def __init__(self, batches: Iterator):
        self.batches = batches

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.batches)
        except DataError as error:
            text, marker = str(error), f"{DataError.__name__}: "
            if "Original Traceback" in text and marker in text:
                text = text.rsplit(marker, 1)[1].strip()
            raise DataError(text, every_rank=False) from None

    def __getattr__(self, name):
        return getattr(self.batches, name)
