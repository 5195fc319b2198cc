"""Llama with Llama 3's RoPE scaling (rope_type llama3, a short original context) and linear position
interpolation, Qwen2 (q/k/v biases) and Qwen3 (QK-norm), transformers as the oracle on tiny random
models it builds offline: the import's logits within 1e-5 of transformers' (fp32), 8 greedy tokens
equal transformers.generate's (KV cache on and off), the export reproduces every tensor and loads in
transformers with equal logits; each feature is in effect; what a converter cannot reproduce is
refused naming the field."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from megafab.convert import ConversionError, export_hf, import_hf
from megafab.inference.generate import SamplingParams, generate
from tests.helpers.hf_tiny import LLAMA3_ROPE, VOCAB, edit_hf_config, hf_dense, megafab_logits, megafab_model

LINEAR_ROPE = dict(rope_type="linear", rope_theta=5000.0, factor=4.0)
CASES = {"llama3": lambda: hf_dense("llama", rope=LLAMA3_ROPE),
         "llama3-tied-mqa": lambda: hf_dense("llama", groups=1, tied=True, rope=LLAMA3_ROPE),
         "llama-linear": lambda: hf_dense("llama", rope=LINEAR_ROPE),
         "qwen2": lambda: hf_dense("qwen2"), "qwen2-llama3": lambda: hf_dense("qwen2", rope=LLAMA3_ROPE),
         "qwen3": lambda: hf_dense("qwen3"), "qwen3-mha-tied": lambda: hf_dense("qwen3", groups=4, tied=True)}
TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))


def _import(hf, path):
    hf.save_pretrained(path)
    return import_hf(str(path))


@pytest.mark.parametrize("name", sorted(CASES))
def test_import_generate_export_equal_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = CASES[name]()
    sd, cfg = _import(hf, tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits
    model = megafab_model(sd, cfg.model)
    got = megafab_logits(model, TOKENS, VOCAB)
    assert (got - want).abs().max().item() < 1e-5

    prompt = TOKENS[0, :6].tolist()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 6:].tolist()
    for cache in (True, False):
        assert generate(model, prompt, SamplingParams(max_new_tokens=8), use_kv_cache=cache) == theirs

    arch = export_hf(sd, cfg, str(tmp_path / "out"))
    assert arch == hf.config.model_type
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    rope = written.get("rope_parameters") or written["rope_scaling"]
    assert rope["rope_type"] == hf.config.rope_parameters["rope_type"]
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    assert type(reloaded) is type(hf)
    with torch.no_grad():
        assert (reloaded(TOKENS).logits - want).abs().max().item() == 0


@pytest.mark.parametrize("name,field,plain", [
    ("llama3", "use_rope_scaling", False), ("llama-linear", "rotary_seq_len_interpolation_factor", None),
    ("qwen3", "qk_layernorm", False)])
def test_each_feature_is_in_effect(name, field, plain, tmp_path):
    sd, cfg = _import(CASES[name](), tmp_path)
    assert getattr(cfg.model, field) not in (False, None)
    got = megafab_logits(megafab_model(sd, cfg.model), TOKENS, VOCAB)
    off = dataclasses.replace(cfg.model, **{field: plain})
    if field == "qk_layernorm":
        sd = {k: v for k, v in sd.items() if "_layernorm" not in k or "self_attention" not in k}
    assert (megafab_logits(megafab_model(sd, off), TOKENS, VOCAB) - got).abs().max().item() > 1e-3


def test_qwen2_biases_are_on_qkv_only(tmp_path):
    sd, cfg = _import(hf_dense("qwen2"), tmp_path)
    m = cfg.model
    assert m.add_qkv_bias and not m.add_bias_linear
    biases = sorted(k.split("layers.0.")[1] for k in sd if k.endswith("bias") and "layers.0." in k)
    assert biases == ["self_attention.linear_qkv.bias"]
    got = megafab_logits(megafab_model(sd, m), TOKENS, VOCAB)
    zero = {k: (torch.zeros_like(v) if k.endswith("linear_qkv.bias") else v) for k, v in sd.items()}
    assert (megafab_logits(megafab_model(zero, m), TOKENS, VOCAB) - got).abs().max().item() > 1e-3


def test_imported_rope_values(tmp_path):
    _, cfg = _import(hf_dense("llama", rope=LLAMA3_ROPE), tmp_path)
    m = cfg.model
    assert (m.use_rope_scaling, m.rope_scaling_factor, m.rope_scaling_low_freq_factor,
            m.rope_scaling_high_freq_factor, m.rope_scaling_original_max_position_embeddings,
            m.rotary_base) == (True, 8.0, 1.0, 4.0, 512, 5000)


@pytest.mark.parametrize("family,changes,field", [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "'yarn'"),
    ("llama", {"rope_parameters": {"attention_factor": 0.5}}, "attention_factor=0.5"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "sliding_window 16"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
])
def test_config_values_not_reproduced_are_refused_by_name(family, changes, field, tmp_path):
    hf_dense(family).save_pretrained(tmp_path)
    edit_hf_config(tmp_path, **changes)
    with pytest.raises(ConversionError, match=field):
        import_hf(str(tmp_path))


def test_exports_that_hf_cannot_hold_are_refused_by_name(tmp_path):
    sd, cfg = _import(hf_dense("llama", rope=LLAMA3_ROPE), tmp_path / "hf")
    cfg.model.rotary_seq_len_interpolation_factor = 2.0
    with pytest.raises(ConversionError, match="--rotary-seq-len-interpolation-factor"):
        export_hf(sd, cfg, str(tmp_path / "out"))
    sd, cfg = _import(hf_dense("qwen3"), tmp_path / "q3")
    cfg.model.add_qkv_bias = True
    for i in range(cfg.model.num_layers):
        sd[f"decoder.layers.{i}.self_attention.linear_qkv.bias"] = torch.zeros(64)
    with pytest.raises(ConversionError, match="add_qkv_bias"):
        export_hf(sd, cfg, str(tmp_path / "out"))
