"""The three index arrays behind a GPT dataset, built with vectorized numpy (Megatron's semantics).

document_index  [E * docs] int32: the split's documents tiled over E epochs, shuffled.
sample_index    [S + 1, 2]: (position in document_index, token offset) where sample s starts; sample s
                covers seq_length + 1 tokens from row s, so consecutive samples share one token.
shuffle_index   [S]: the order in which samples are served.
"""

from __future__ import annotations

import numpy as np

from megafab.progress import Progress

LARGE_INDEX = 10_000_000  # document-index entries from which an index build shows its steps

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Smallest number of epochs holding num_samples samples of seq_length + 1 tokens."""
    if num_samples is None:
        return 1
    tokens_requested = num_samples * seq_length + 1
    return max(1, -(-tokens_requested // tokens_per_epoch))


def samples_in(num_tokens: int, seq_length: int) -> int:
    return (num_tokens - 1) // seq_length


def use_separate_final_epoch(tokens_per_epoch: int, num_epochs: int, num_samples: int | None,
                             seq_length: int) -> bool:
    """True when the last epoch is needed for under 80% of its samples: it is then shuffled apart."""
    if num_epochs == 1 or num_samples is None:
        return False
    samples_before_final = samples_in((num_epochs - 1) * tokens_per_epoch, seq_length)
    samples_from_final = num_samples - samples_before_final
    samples_per_epoch = samples_in(tokens_per_epoch, seq_length)
    assert 0 <= samples_from_final <= samples_per_epoch + 1
    return samples_from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Tile documents over num_epochs and shuffle (the last epoch on its own when separate)."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """Sample s starts at token s * seq_length of the flattened document_index stream.

    The row is (d, offset) with d the document holding that token; empty documents are skipped. Row 0
    is (0, 0) whatever the first document's length.
    """
    num_samples = samples_in(num_epochs * tokens_per_epoch, seq_length)
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    docs = np.searchsorted(starts, positions, side="right") - 1
    offsets = positions - starts[docs]
    docs[0], offsets[0] = 0, 0
    dtype = np.int32 if max(len(document_index), int(lengths.max(initial=0))) < 2**31 - 1 else np.int64
    return np.stack([docs, offsets], axis=1).astype(dtype)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffle [0, num_samples) and, separately, [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: int | None,
                      seq_length: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for the given documents of a dataset."""
    tokens_per_epoch = int(np.sum(np.asarray(sequence_lengths)[documents], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    separate = use_separate_final_epoch(tokens_per_epoch, num_epochs, num_samples, seq_length)
    rng = np.random.RandomState(seed)
    steps = Progress(3, f"index build ({num_epochs} epoch(s) of {len(documents):,} documents)", unit="index",
                     enabled=None if len(documents) * num_epochs >= LARGE_INDEX else False)
    try:
        document_index = build_document_index(documents, num_epochs, rng, separate)
        steps.update(1)
        sample_index = build_sample_index(sequence_lengths, document_index, seq_length, num_epochs,
                                          tokens_per_epoch)
        steps.update(1)
        total = sample_index.shape[0] - 1
        if separate:
            num_samples_sans_final = samples_in((num_epochs - 1) * tokens_per_epoch, seq_length)
            shuffle_index = build_shuffle_index(num_samples_sans_final, total, rng)
        else:
            shuffle_index = build_shuffle_index(total, total, rng)
        steps.update(1)
    finally:
        steps.close()
    return document_index, sample_index, shuffle_index
