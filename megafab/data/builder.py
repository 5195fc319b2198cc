"""build_gpt_datasets: Megatron's --data-path / --split / per-split paths -> (train, valid, test)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from megafab.data.blend_spec import parse_blend, parse_split
from megafab.data.blended_dataset import BlendedDataset
from megafab.data.errors import DataError
from megafab.data.gpt_dataset import GPTDataset
from megafab.data.indexed_dataset import IndexedDataset, dtype_for_vocab
from megafab.data.mock import MockIndexedDataset
from megafab.data.token_range import check_dataset

SPLIT_NAMES = ("train", "valid", "test")
# megatron-core's BlendedMegatronDatasetConfig sets split "1,1,1" for mock data without --data-path,
# whatever --split says ("an arbitrarily even split, as mock is True"): three equal parts.
MOCK_SPLIT = "1,1,1"
MID_LEVEL_SURPLUS = 0.005


def split_matrix(fractions: Sequence[float]) -> list[tuple[float, float] | None]:
    """Fractions -> contiguous (begin, end) bookends per split; None for an empty split."""
    bounds, acc = [0.0], 0.0
    for f in fractions:
        acc = acc + f
        bounds.append(acc)
    return [(b, e) if e > b else None for b, e in zip(bounds[:-1], bounds[1:])]


def empty_split_message(prefix: str | None, documents: int, name: str, bookend: tuple[float, float],
                        split: str, samples: int | None) -> str:
    where = prefix or "the mock dataset"
    if documents == 0:
        return f"{where}: the dataset holds no documents; give a dataset with documents"
    wanted = f"the run needs {samples} {name} samples" if samples else f"the run reads the {name} split"
    return (f"{where}: --split {split} gives the {name} split documents round({bookend[0]:.4g} x "
            f"{documents}) .. round({bookend[1]:.4g} x {documents}) of {documents}, i.e. none, but {wanted}; "
            f"give the {name} split a larger share (e.g. --split 90,5,5), use more documents"
            + (", or --eval-iters 0 to evaluate nothing" if name != "train" else ""))


def open_indexed(prefix: str, vocab_size: int | None, mmap: bool = True, **cache) -> IndexedDataset:
    """The dataset of `prefix`, refused if its ids cannot belong to the vocabulary; cache:
    cache_path, barrier, is_builder (see index_cache.cached_arrays)."""
    dataset = IndexedDataset(prefix, mmap=mmap)
    stored = np.dtype(dataset.dtype)
    if vocab_size is not None and stored.kind in "iu" and np.iinfo(stored).max < vocab_size - 1:
        needed = np.dtype(dtype_for_vocab(vocab_size)).name
        raise DataError(f"{prefix}.idx: tokens are stored as {stored.name}, which cannot hold the ids of a "
                        f"{vocab_size}-token vocabulary (needs {needed}); preprocess the data again with "
                        "this tokenizer")
    check_dataset(dataset, vocab_size, **cache)
    return dataset


def build_gpt_datasets(data_path: str | Sequence[str] | None = None, split: str = "969,30,1",
                       seq_length: int = 1024, seed: int = 1234,
                       num_samples: Sequence[int | None] = (None, None, None), tokenizer=None,
                       cache_path: str | None = None, eod_mask_loss: bool = False,
                       reset_position_ids: bool = False, reset_attention_mask: bool = False,
                       mock: bool = False, train_data_path=None, valid_data_path=None, test_data_path=None,
                       barrier: Callable[[], None] | None = None, is_builder: bool = True,
                       mid_level_surplus: float = MID_LEVEL_SURPLUS, mmap_bin_files: bool = True,
                       inter_document_masking: bool = False) -> list:
    """(train, valid, test) datasets (None for an absent split) with megatron-core's sample order.
    mmap_bin_files False: read the .bin files with file reads (--no-mmap-bin-files);
    inter_document_masking: items carry cu_seqlens (GPTDataset, megafab.data.packed_documents).

    data_path / *_data_path take Megatron's forms: "P", "P1 P2" (weights = sizes) or "w1 P1 w2 P2"
    (a string or a list of strings). Item i is a dict of torch tensors: tokens [s] int64, labels
    [s] int64, loss_mask [s] float32, position_ids [s] int64, plus attention_mask [1, s, s] bool
    (True = masked out) only when reset_attention_mask. Index arrays are cached under cache_path
    (no caching when None): the process with is_builder=True builds on a miss, `barrier()` (e.g.
    lambda: dist.barrier(group)) is called once per index by every process, then all memory-map
    the .npy files."""
    if tokenizer is None:
        raise DataError("build_gpt_datasets needs a tokenizer (for eod, pad and vocab size)")
    if seq_length < 2:
        raise DataError(f"seq_length {seq_length} must be at least 2")
    per_split = [train_data_path, valid_data_path, test_data_path]
    if not mock and data_path is None and all(p is None for p in per_split):
        raise DataError("no data: give --data-path, or --train/valid/test-data-path, or --mock-data")
    if data_path is not None and any(p is not None for p in per_split):
        raise DataError("--data-path and --train/valid/test-data-path are mutually exclusive; give one")
    vocab_size = getattr(tokenizer, "vocab_size", None)
    common = dict(seq_length=seq_length, seed=seed, eod=tokenizer.eod, pad=getattr(tokenizer, "pad", None),
                  vocab_size=vocab_size,
                  eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids,
                  reset_attention_mask=reset_attention_mask, cache_path=cache_path, barrier=barrier,
                  is_builder=is_builder, inter_document_masking=inter_document_masking)
    blended = dict(cache_path=cache_path, barrier=barrier, is_builder=is_builder)
    sizes = list(num_samples)

    def mid_level(low, prefix, matrix, counts):
        n = len(low.sequence_lengths)
        out = []
        for i, bookend in enumerate(matrix):
            if bookend is None:
                out.append(None)
                continue
            beg, end = int(round(bookend[0] * n)), int(round(bookend[1] * n))
            if end <= beg and counts[i] == 0:  # an empty split nobody reads: absent, as if not asked
                out.append(None)
                continue
            if end <= beg:
                raise DataError(empty_split_message(prefix, n, SPLIT_NAMES[i], bookend, split, counts[i]))
            documents = np.arange(beg, end, dtype=np.int32)
            out.append(GPTDataset(low, prefix, documents, counts[i], SPLIT_NAMES[i], **common))
        return out

    def from_blend(blend, matrix, counts):
        prefixes, weights = blend
        if len(prefixes) == 1 and weights is None:
            low = open_indexed(prefixes[0], vocab_size, mmap_bin_files, **blended)
            return mid_level(low, prefixes[0], matrix, counts)
        if weights is not None:
            total = float(np.sum(np.asarray(weights, dtype=np.float64)))
            weights = (np.asarray(weights, dtype=np.float64) / total).tolist()
            for i, c in enumerate(counts):
                if c is None and matrix[i] is not None:
                    raise DataError("weighted blends need a sample count for every split")
            target = [[math.ceil(c * w) if c is not None else None for c in counts] for w in weights]
            buffered = [[math.ceil(math.ceil(c * w) * (1 + mid_level_surplus)) if c is not None else None
                         for c in counts] for w in weights]
        else:
            buffered = [[None] * 3 for _ in prefixes]
        mids = [mid_level(open_indexed(p, vocab_size, mmap_bin_files, **blended), p, matrix, buffered[j])
                for j, p in enumerate(prefixes)]
        out = []
        for i in range(3):
            datasets = [m[i] for m in mids]
            if matrix[i] is None or any(d is None for d in datasets):
                out.append(None)
                continue
            if weights is not None:
                size, split_weights = sum(t[i] for t in target), weights
            else:
                split_weights = [len(d) for d in datasets]
                size = sum(split_weights) if counts[i] is None else min(counts[i], sum(split_weights))
            out.append(BlendedDataset(datasets, split_weights, size, SPLIT_NAMES[i], **blended))
        return out

    if mock:
        low = MockIndexedDataset(vocab_size, tokenizer.eod)
        matrix = split_matrix(parse_split(MOCK_SPLIT if data_path is None else split))
        return mid_level(low, None, matrix, sizes)
    if data_path is not None:
        return from_blend(parse_blend(data_path), split_matrix(parse_split(split)), sizes)
    result = []
    for i, path in enumerate(per_split):
        if path is None:
            result.append(None)
            continue
        matrix = [None, None, None]
        matrix[i] = (0.0, 1.0)
        counts = [0, 0, 0]
        counts[i] = sizes[i]
        result.append(from_blend(parse_blend(path), matrix, counts)[i])
    return result
