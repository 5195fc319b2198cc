"""Sampler semantics and resume, the micro-batch iterator, every tokenizer type, mock data, index speed."""

import json
import time

import numpy as np
import pytest
import torch

from megafab.data import DataError, MegatronPretrainingSampler, build_data_iterator, build_gpt_datasets
from megafab.data.sample_index import build_gpt_indices
from megafab.data.tokenizers import build_tokenizer


def test_sampler_slices_consecutive_global_batches():
    batches = [list(MegatronPretrainingSampler(20, 0, 2, r, 3)) for r in range(3)]
    assert batches[0] == [[0, 1], [6, 7], [12, 13]]
    assert batches[2] == [[4, 5], [10, 11], [16, 17]]
    assert list(MegatronPretrainingSampler(20, 0, 2, 2, 3, drop_last=False))[-1] == []
    assert list(MegatronPretrainingSampler(20, 0, 2, 0, 3, drop_last=False))[-1] == [18, 19]


def test_sampler_resume_continues_exactly():
    full = list(MegatronPretrainingSampler(64, 0, 4, 1, 2))
    resumed = list(MegatronPretrainingSampler(64, 3 * 8, 4, 1, 2))
    assert resumed == full[3:]


def test_sampler_rejects_used_up_data():
    with pytest.raises(DataError, match="consumed_samples 10 must be in"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)


def test_mock_iterator_collates_micro_batches():
    tok = build_tokenizer("NullTokenizer", vocab_size=127)
    train, valid, test = build_gpt_datasets(mock=True, split="98,2,0", seq_length=16, seed=5,
                                            num_samples=(32, 8, 0), tokenizer=tok, eod_mask_loss=True,
                                            reset_position_ids=True, reset_attention_mask=True)
    # megatron-core cuts the mock documents 1,1,1 whatever --split says
    assert [(int(d.documents[0]), len(d.documents)) for d in (train, valid, test)] == \
        [(0, 33_333), (33_333, 33_334), (66_667, 33_333)]
    assert len(train) >= 32
    batch = next(build_data_iterator(train, 4, 2, 1, 2))
    assert batch["tokens"].shape == (2, 16) and batch["attention_mask"].shape == (2, 1, 16, 16)
    assert batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][0], train[6]["tokens"])
    assert torch.equal(batch["labels"][0, :-1], batch["tokens"][0, 1:])
    eod = batch["tokens"] == tok.eod
    assert torch.all(batch["loss_mask"][eod] == 0) and torch.all(batch["loss_mask"][~eod] == 1)


def test_null_and_sentencepiece_family(tmp_path):
    null = build_tokenizer("NullTokenizer", vocab_size=10)
    assert (null.vocab_size, null.eod, null.tokenize("3 1 4")) == (11, 10, [3, 1, 4])
    import sentencepiece

    text = "the quick brown fox jumps over the lazy dog. " * 50
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text.split(". ")),
                                             model_prefix=str(tmp_path / "sp"), vocab_size=32,
                                             bos_id=1, eos_id=2, unk_id=0, pad_id=3, minloglevel=2)
    model = str(tmp_path / "sp.model")
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=model)
    mega = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    ids = gpt.tokenize("the lazy fox")
    assert (gpt.eod, gpt.pad, gpt.vocab_size) == (2, 3, 32) and gpt.detokenize(ids) == "the lazy fox"
    assert llama.tokenize("the lazy fox") == [1] + ids
    assert mega.vocab_size == 39 and mega.eod == 34 and mega.tokenize("the lazy fox") == ids


def test_gpt2_bpe_and_huggingface_files(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world, hello megafab"] * 20, vocab_size=300,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(tmp_path))
    bpe.save(str(tmp_path / "tokenizer.json"))
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                           merge_file=str(tmp_path / "merges.txt"))
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json"))
    vocab = json.load(open(tmp_path / "vocab.json"))
    ids = gpt2.tokenize("hello megafab world")
    assert gpt2.eod == vocab["<|endoftext|>"] == hf.eod and gpt2.vocab_size == len(vocab)
    assert ids == bpe.encode("hello megafab world").ids == hf.tokenize("hello megafab world")
    assert gpt2.detokenize(ids) == "hello megafab world"


def test_tokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(DataError, match="needs --vocab-file"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(DataError, match="--tokenizer-model .*nope.model: file not found"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))
    with pytest.raises(DataError, match="'BertWordPiece' is not supported"):
        build_tokenizer("BertWordPiece")


def test_index_build_for_a_billion_tokens_takes_seconds():
    lengths = np.random.default_rng(0).integers(1, 2000, size=1_000_000).astype(np.int32)  # ~1e9 tokens
    start = time.perf_counter()
    document_index, sample_index, shuffle_index = build_gpt_indices(
        lengths, np.arange(len(lengths), dtype=np.int32), None, 2048, 1234)
    assert time.perf_counter() - start < 60
    assert len(shuffle_index) == (int(lengths.sum(dtype=np.int64)) - 1) // 2048
    assert sorted(document_index[:1000].tolist()) != document_index[:1000].tolist()  # shuffled
    assert sample_index.shape == (len(shuffle_index) + 1, 2)
