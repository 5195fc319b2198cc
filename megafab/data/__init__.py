"""Data layer: Megatron .bin/.idx datasets, tokenizers, GPT samples, blends, samplers.

Public API, plain arguments and no config object (each function's docstring has its contract):
build_tokenizer (Megatron's --tokenizer-type, local files only); build_gpt_datasets ([train, valid,
test], the same samples in the same order as megatron-core 0.16.1); MegatronPretrainingSampler and
build_data_iterator (this DP rank's micro-batches from consumed_samples on); IndexedDataset,
IndexedDatasetWriter, merge_datasets, dtype_for_vocab (the .bin/.idx format); parse_blend,
parse_split (Megatron's --data-path and --split forms). DataError (a ValueError) is every
user-facing data problem, naming the file or value.
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
