"""Megatron's --padded-vocab-size (the given size used as it is, not derived; it must hold the
vocabulary and split evenly over TP) and --trust-remote-code (passed to HuggingFace's AutoTokenizer
for HuggingFaceTokenizer, which still reads local files only)."""

import os

import pytest

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from megafab.plan.layout_candidate import LayoutCandidate, strip_layout_flags
from megafab.plan.search import _Builder
from tests.helpers.flags import BASE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_DIR = os.path.join(ROOT, "tests", "data", "fixtures", "hf_tiny")


def test_a_given_padded_vocab_size_is_used_as_it_is():
    assert config_from_args(BASE, world_size=1).model.padded_vocab_size == 1024  # derived
    cfg = config_from_args(BASE + ["--padded-vocab-size", "1010"], world_size=1)
    assert (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (1000, 1010)


def test_a_given_padded_vocab_size_survives_the_tokenizer_sizing():
    # NullTokenizer's vocabulary is --vocab-size plus its end-of-document id: 1001
    cfg = config_from_args(BASE + ["--padded-vocab-size", "1010"], world_size=1, start_up=True)
    assert (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (1001, 1010)
    assert config_from_args(BASE, world_size=1, start_up=True).model.padded_vocab_size == 1024
    with pytest.raises(ConfigError, match=r"--padded-vocab-size 1000 is smaller than the vocabulary size "
                                          r"1001; give at least 1001, or leave it out to derive it"):
        config_from_args(BASE + ["--padded-vocab-size", "1000"], world_size=1, start_up=True)


def test_the_padded_vocab_size_rules():
    with pytest.raises(ConfigError, match=r"--padded-vocab-size 999 is smaller than the vocabulary size "
                                          r"1000; give at least 1000, or leave it out to derive it"):
        config_from_args(BASE + ["--padded-vocab-size", "999"], world_size=1)
    with pytest.raises(ConfigError, match=r"--padded-vocab-size 1011 is not divisible by "
                                          r"--tensor-model-parallel-size 2; each TP rank holds an equal "
                                          r"slice of the vocabulary: give a multiple of 2"):
        config_from_args(BASE + ["--padded-vocab-size", "1011", "--tensor-model-parallel-size", "2"],
                         world_size=2)


def test_the_layout_search_keeps_a_given_padded_vocab_size():
    model = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--vocab-size", "127", "--make-vocab-size-divisible-by", "32", "--global-batch-size", "8"]
    cand = LayoutCandidate(tensor_model_parallel_size=2, micro_batch_size=1)
    derived = strip_layout_flags(model)
    base = config_from_args(derived + ["--micro-batch-size", "1", "--dry-run"], world_size=1)
    assert _Builder(base, derived, 4).build(cand).model.padded_vocab_size == 128  # derived per candidate
    given = strip_layout_flags(model + ["--padded-vocab-size", "130"])
    base = config_from_args(given + ["--micro-batch-size", "1", "--dry-run"], world_size=1)
    assert _Builder(base, given, 4).build(cand).model.padded_vocab_size == 130
    four = LayoutCandidate(tensor_model_parallel_size=4, micro_batch_size=1)
    assert _Builder(base, given, 4).build(four) is None  # 130 rows do not split over TP 4


@pytest.mark.parametrize("trust", [False, True])
def test_trust_remote_code_reaches_autotokenizer(trust, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from megafab.checks import probes
    from megafab.checks.probes import tokenizer_of

    real, calls = transformers.AutoTokenizer.from_pretrained, []

    def recording(path, *args, **kwargs):
        calls.append(kwargs)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    monkeypatch.setattr(probes, "_BUILT", {})  # built afresh here, not by an earlier test of this process
    monkeypatch.setattr(probes, "_SIZED", {})
    flags = [f for f in BASE if f not in ("--vocab-size", "1000")] + [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", HF_DIR]
    cfg = config_from_args(flags + (["--trust-remote-code"] if trust else []), world_size=1, start_up=True)
    assert cfg.data.trust_remote_code is trust
    tokenizer_of(cfg.data, cfg.model.vocab_size)
    assert calls and all(c["trust_remote_code"] is trust and c["local_files_only"] for c in calls)
