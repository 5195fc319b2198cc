"""Data layer: Megatron .bin/.idx datasets, tokenizers, GPT samples, blends, samplers.

Public API (plain arguments, no config object):

build_tokenizer(tokenizer_type, vocab_file=None, merge_file=None, tokenizer_model=None, vocab_size=None)
    -> tokenizer with tokenize(text) -> list[int], detokenize(ids) -> str, vocab_size, eod, pad (or None).
    Types: GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer,
    HuggingFaceTokenizer, NullTokenizer. Local files only.

build_gpt_datasets(data_path=None, split="969,30,1", seq_length=1024, seed=1234,
                   num_samples=(train, valid, test), tokenizer=..., cache_path=None, eod_mask_loss=False,
                   reset_position_ids=False, reset_attention_mask=False, mock=False,
                   train_data_path=None, valid_data_path=None, test_data_path=None,
                   barrier=None, is_builder=True)
    -> [train, valid, test] datasets (None for an absent split), same samples in the same order as
    megatron-core 0.16.1. data_path / *_data_path take Megatron's forms: "P", "P1 P2" (weights =
    sizes) or "w1 P1 w2 P2" (a string or a list of strings). Item i is a dict of torch tensors:
    tokens [s] int64, labels [s] int64, loss_mask [s] float32, position_ids [s] int64, plus
    attention_mask [1, s, s] bool (True = masked out) only when reset_attention_mask.
    Index arrays are cached under cache_path (no caching when None): the process with
    is_builder=True builds on a miss, `barrier()` (e.g. lambda: dist.barrier(group)) is called once
    per index by every process, then all memory-map the .npy files.

MegatronPretrainingSampler(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                           data_parallel_size, drop_last=True)
    -> iterates this DP rank's micro-batches of sample indices from consumed_samples on.
build_data_iterator(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size, num_workers=0)
    -> iterator of collated micro-batches (dict of [b, s] tensors), or None when dataset is None.

IndexedDataset(path_prefix), IndexedDatasetWriter(bin_path, dtype), merge_datasets(prefixes, out),
dtype_for_vocab(vocab_size): the .bin/.idx format (megafab/data/indexed_dataset.py).
DataError (a ValueError): every user-facing data problem, naming the file or value.
"""

import importlib

# Lazy, so that `megafab.data.preprocess` (tools/preprocess_data.py) starts without importing torch.
_HOME = {
    "build_gpt_datasets": "megafab.data.builder",
    "parse_blend": "megafab.data.builder",
    "parse_split": "megafab.data.builder",
    "DataError": "megafab.data.errors",
    "IndexedDataset": "megafab.data.indexed_dataset",
    "IndexedDatasetWriter": "megafab.data.indexed_dataset",
    "dtype_for_vocab": "megafab.data.indexed_dataset",
    "merge_datasets": "megafab.data.indexed_dataset",
    "MegatronPretrainingSampler": "megafab.data.samplers",
    "build_data_iterator": "megafab.data.samplers",
    "build_tokenizer": "megafab.data.tokenizers",
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'megafab.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


__all__ = [
    "DataError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "MegatronPretrainingSampler",
    "build_data_iterator",
    "build_gpt_datasets",
    "build_tokenizer",
    "dtype_for_vocab",
    "merge_datasets",
    "parse_blend",
    "parse_split",
]
