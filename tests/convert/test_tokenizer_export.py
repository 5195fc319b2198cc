"""Exported HF directories carry a tokenizer that encodes like the training tokenizer, and the
config's eos_token_id is its end-of-document token."""

import json

import pytest

from megafab.convert import export_hf, import_hf
from megafab.data.tokenizers import build_tokenizer
from tests.helpers.hf_tiny import hf_gpt2, hf_llama

TEXT = ["the quick brown fox jumps over the lazy dog", "a lazy dog sleeps", "quick quick fox"] * 20
SAMPLE = "the lazy fox jumps"


def _hf_tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]))
    tok.save(str(path))
    return str(path)


def _sentencepiece_model(tmp_path):
    import sentencepiece as spm

    (tmp_path / "corpus.txt").write_text("\n".join(TEXT))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=40, model_type="bpe", bos_id=1, eos_id=2, unk_id=0,
                                   minloglevel=2)
    return str(tmp_path / "sp.model")


KINDS = ["HuggingFaceTokenizer", "GPTSentencePieceTokenizer", "SentencePieceTokenizer"]


@pytest.mark.parametrize("kind", KINDS)
def test_exported_tokenizer_encodes_like_training(kind, tmp_path):
    from transformers import AutoTokenizer

    hf = hf_gpt2() if kind == "HuggingFaceTokenizer" else hf_llama()
    hf.save_pretrained(tmp_path / "hf")
    sd, cfg = import_hf(str(tmp_path / "hf"))
    cfg.data.tokenizer_type = kind
    if kind == "HuggingFaceTokenizer":
        cfg.data.tokenizer_model = _hf_tokenizer_json(tmp_path / "tokenizer.json")
    else:
        cfg.data.tokenizer_model = _sentencepiece_model(tmp_path)
    export_hf(sd, cfg, str(tmp_path / "out"))

    ours = build_tokenizer(kind, tokenizer_model=cfg.data.tokenizer_model)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert theirs.encode(SAMPLE, add_special_tokens=False) == ours.tokenize(SAMPLE)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] == ours.eod == theirs.eos_token_id
