"""--tokenizer-type TikTokenizer --tiktoken-pattern v1|v2 from a local Megatron tiktoken vocabulary:
the same ids as megatron-core 0.16.1's TikTokenTokenizer, nothing downloaded."""

import base64
import json
import warnings

import pytest

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from megafab.data.errors import DataError
from megafab.data.tokenizers import TIKTOKEN_PATTERNS, build_tokenizer
from tests.helpers.flags import tiny_flags

MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"er", b"Th", b"12"]
TEXT = "The thing\nthe other THING 1234, ünïcode? the end\r\n  spaces"


def write_vocab(path, merges=MERGES):
    tokens = [bytes([i]) for i in range(256)] + merges
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                "token_str": t.decode("utf-8", "replace")} for i, t in enumerate(tokens)]
    path.write_text(json.dumps(entries))
    return len(tokens)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_ids_equal_megatron_core(tmp_path, pattern):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as mc

    assert TIKTOKEN_PATTERNS[pattern] == getattr(mc, f"_PATTERN_TIKTOKEN_{pattern.upper()}")
    path = tmp_path / "vocab.json"
    size = write_vocab(path) + 16  # 16 special ids in front of the BPE ranks
    ours = build_tokenizer("TikTokenizer", tokenizer_model=str(path), vocab_size=size,
                           tiktoken_pattern=pattern, num_special_tokens=16)
    theirs = mc.TikTokenTokenizer(str(path), num_special_tokens=16, pattern=pattern, vocab_size=size)
    ids = ours.tokenize(TEXT)
    assert ids == theirs.text_to_ids(TEXT)
    assert min(ids) >= 16 and any(i >= 16 + 256 for i in ids)  # shifted ranks, merges used
    assert ours.detokenize(ids) == TEXT
    assert (ours.eod, ours.vocab_size) == (theirs.eos_id, size) == (2, size)


def test_vocabulary_errors_and_config_rules(tmp_path):
    path = tmp_path / "vocab.json"
    write_vocab(path)
    with pytest.raises(DataError, match="fewer than the"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(path), vocab_size=4096, tiktoken_pattern="v2",
                        num_special_tokens=16)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="not a Megatron tiktoken vocabulary"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(tmp_path / "bad.json"), vocab_size=300,
                        tiktoken_pattern="v2", num_special_tokens=16)
    base = tiny_flags(num_layers=2) + [
        "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--mock-data"]
    with pytest.raises(ConfigError) as info:
        config_from_args(base + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(path)],
                         world_size=1)
    assert "needs --tiktoken-pattern v1 or v2" in str(info.value)
    cfg = config_from_args(base + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
                                   "--tiktoken-pattern", "v2"], world_size=1)
    notes = cfg.start_up_notes()
    assert any("--tiktoken-pattern (only --tokenizer-type TikTokenizer reads it)" in n for n in notes)
