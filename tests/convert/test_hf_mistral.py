"""Mistral (sliding-window attention on every layer), transformers as the oracle on tiny random models
it builds offline with a window shorter than the sequence: the import's logits within 1e-5 of
transformers' (fp32), 8 greedy tokens equal transformers.generate's with the window crossing the
prompt (KV cache on and off), the export reproduces every tensor and loads in transformers with equal
logits; the window is in effect; what Mistral cannot hold is refused by name."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

from megafab.convert import ConversionError, export_hf, import_hf  # noqa: E402
from megafab.inference.generate import SamplingParams, generate  # noqa: E402
from tests.helpers.hf_tiny import LLAMA3_ROPE, VOCAB, edit_hf_config, hf_dense, megafab_logits, megafab_model  # noqa: E402

WINDOW = 5  # HF's sliding_window: a query sees itself and the 4 positions before it
CASES = {"mistral": lambda: hf_dense("mistral", sliding_window=WINDOW),
         "mistral-mqa-tied": lambda: hf_dense("mistral", groups=1, tied=True, sliding_window=WINDOW),
         "mistral-llama3-rope": lambda: hf_dense("mistral", rope=LLAMA3_ROPE, sliding_window=WINDOW)}
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def _import(hf, path):
    hf.save_pretrained(path)
    return import_hf(str(path))


@pytest.mark.parametrize("name", sorted(CASES))
def test_import_generate_export_equal_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = CASES[name]()
    sd, cfg = _import(hf, tmp_path / "hf")
    assert cfg.model.window_size == (WINDOW - 1, 0) and cfg.model.window_attn_skip_freq is None
    with torch.no_grad():
        want = hf(TOKENS).logits
    model = megafab_model(sd, cfg.model)
    assert (megafab_logits(model, TOKENS, VOCAB) - want).abs().max().item() < 1e-5

    prompt = TOKENS[0, :9].tolist()  # longer than the window: generation slides it across the prompt
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 9:].tolist()
    for cache in (True, False):
        assert generate(model, prompt, SamplingParams(max_new_tokens=8), use_kv_cache=cache) == theirs

    assert export_hf(sd, cfg, str(tmp_path / "out")) == "mistral"
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(original) and all(torch.equal(exported[k], v) for k, v in original.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == WINDOW
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - want).abs().max().item() < 1e-5


def test_the_window_is_in_effect(tmp_path):
    """The same weights with the window as long as the context: different logits past the window."""
    hf = CASES["mistral"]()
    sd, cfg = _import(hf, tmp_path / "hf")
    edit_hf_config(tmp_path / "hf", sliding_window=None)
    sd_full, cfg_full = import_hf(str(tmp_path / "hf"))
    assert cfg_full.model.window_size is None
    windowed = megafab_logits(megafab_model(sd, cfg.model), TOKENS, VOCAB)
    full = megafab_logits(megafab_model(sd_full, cfg_full.model), TOKENS, VOCAB)
    assert torch.allclose(windowed[:, :WINDOW], full[:, :WINDOW], atol=1e-6)  # inside the window: equal
    assert (windowed[:, WINDOW:] - full[:, WINDOW:]).abs().max() > 1e-3


def test_what_mistral_cannot_hold_is_refused_by_name(tmp_path):
    sd, cfg = _import(CASES["mistral"](), tmp_path / "hf")
    for field, value, named in (("window_attn_skip_freq", 2, "--window-attn-skip-freq"),
                                ("softmax_type", "off-by-one", "--softmax-type"),
                                ("window_size", (WINDOW - 1, 2), "--window-size")):
        model = dataclasses.replace(cfg.model, **{field: value})
        with pytest.raises(ConversionError, match=named):
            export_hf(sd, dataclasses.replace(cfg, model=model), str(tmp_path / field))
    edit_hf_config(tmp_path / "hf", sliding_window=0)
    with pytest.raises(ConversionError, match="sliding_window 0"):
        import_hf(str(tmp_path / "hf"))
