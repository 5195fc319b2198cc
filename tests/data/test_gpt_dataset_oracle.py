"""megafab's GPTDataset and blends yield megatron-core 0.16.1's samples, in its order."""

import warnings

import numpy as np
import pytest

from megafab.data.builder import build_gpt_datasets
from megafab.data.indexed_dataset import IndexedDatasetWriter

EOD = 511
VOCAB = 512


class OracleTokenizer:
    """What megatron-core's GPTDatasetConfig needs from a tokenizer (and what megafab's needs)."""

    eod = EOD
    pad = None
    vocab_size = VOCAB
    unique_identifiers = {"class": "OracleTokenizer"}


def write_corpus(prefix, seed, num_docs):
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(prefix + ".bin", np.uint16)
    for _ in range(num_docs):
        n = int(rng.integers(1, 40))
        writer.add_document(np.append(rng.integers(0, EOD, size=n - 1), EOD))
    writer.finalize(prefix + ".idx")


def megatron_datasets(blend, split, seq_length, seed, sizes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    # no path_to_cache: its blend cache wants torch.distributed; indices then go under PREFIX/cache
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, split=split, path_to_cache=None,
        tokenizer=OracleTokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def assert_same_samples(ours, theirs):
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert len(a) == len(b)
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert np.array_equal(x["tokens"].numpy(), y["tokens"].numpy()), i
            assert np.array_equal(x["labels"].numpy(), y["labels"].numpy()), i


@pytest.mark.parametrize("seq_length,sizes", [(16, [200, 30, 8]), (7, [1500, 40, 5])])
def test_single_dataset_matches_megatron_core(tmp_path, seq_length, sizes):
    prefix = str(tmp_path / "a_text_document")
    write_corpus(prefix, 0, 300)
    theirs = megatron_datasets(([prefix], None), "90,7,3", seq_length, 1234, sizes)
    ours = build_gpt_datasets(prefix, "90,7,3", seq_length, 1234, sizes, OracleTokenizer(),
                              cache_path=str(tmp_path / "mf"))
    assert_same_samples(ours, theirs)


def test_weighted_blend_matches_megatron_core(tmp_path):
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    write_corpus(a, 1, 200)
    write_corpus(b, 2, 120)
    sizes = [300, 40, 10]
    theirs = megatron_datasets(([a, b], [0.3, 0.7]), "80,15,5", 12, 7, sizes)
    ours = build_gpt_datasets(f"0.3 {a} 0.7 {b}", "80,15,5", 12, 7, sizes, OracleTokenizer(),
                              cache_path=str(tmp_path / "mf"))
    assert_same_samples(ours, theirs)


def test_unweighted_blend_matches_megatron_core(tmp_path):
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    write_corpus(a, 3, 100)
    write_corpus(b, 4, 60)
    sizes = [100, 20, 5]
    theirs = megatron_datasets(([a, b], None), "85,10,5", 10, 3, sizes)
    ours = build_gpt_datasets([a, b], "85,10,5", 10, 3, sizes, OracleTokenizer(), cache_path=None)
    assert_same_samples(ours, theirs)


def test_cache_is_reused_and_memory_mapped(tmp_path):
    prefix = str(tmp_path / "a_text_document")
    write_corpus(prefix, 0, 50)
    first = build_gpt_datasets(prefix, "1,0,0", 8, 1, [40, None, None], OracleTokenizer(),
                               cache_path=str(tmp_path / "c"))[0]
    calls = []
    second = build_gpt_datasets(prefix, "1,0,0", 8, 1, [40, None, None], OracleTokenizer(),
                                cache_path=str(tmp_path / "c"), barrier=lambda: calls.append(1),
                                is_builder=False)[0]
    assert calls == [1, 1]  # one barrier per cached index: the token-id range, the sample index
    assert isinstance(second.shuffle_index, np.memmap)
    assert np.array_equal(first[5]["tokens"].numpy(), second[5]["tokens"].numpy())
