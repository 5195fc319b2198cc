"""HF -> megafab -> HF reproduces every tensor; megafab's logits equal transformers' (fp32, 1e-4)."""

import pytest
import torch
from safetensors.torch import load_file

from megafab.convert import ConversionError, export_hf, import_hf
from megafab.convert.state_dict import WORD_EMBEDDING, pack_qkv, unpack_qkv
from tests.helpers.hf_tiny import VOCAB, hf_gpt2, hf_llama, megafab_logits, megafab_model

BUILDERS = {"gpt2": lambda: hf_gpt2(), "gpt2-untied": lambda: hf_gpt2(tied=False),
            "gpt2-gelu-new": lambda: hf_gpt2(activation="gelu_new"),
            "gpt2-relu2": lambda: hf_gpt2(activation="relu2"),
            "llama-gqa": lambda: hf_llama(groups=2), "llama-mha-tied": lambda: hf_llama(groups=4, tied=True),
            "llama-mqa": lambda: hf_llama(groups=1)}


def _tokens(b=2, s=12, seed=0):
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_round_trip_and_logits(name, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = BUILDERS[name]()
    hf.save_pretrained(tmp_path / "hf")
    sd, cfg = import_hf(str(tmp_path / "hf"))
    assert sd[WORD_EMBEDDING].shape[0] == cfg.model.padded_vocab_size == 128

    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
    got = megafab_logits(megafab_model(sd, cfg.model), tokens, VOCAB)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    export_hf(sd, cfg, str(tmp_path / "out"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, want, rtol=0, atol=0)


def test_gpt2_export_uses_exact_gelu(tmp_path):
    hf = hf_gpt2()
    hf.save_pretrained(tmp_path / "hf")
    sd, cfg = import_hf(str(tmp_path / "hf"))
    export_hf(sd, cfg, str(tmp_path / "out"))
    import json

    assert json.loads((tmp_path / "out" / "config.json").read_text())["activation_function"] == "gelu"


def test_gpt2_tanh_gelu_imports_exactly_as_openai_gelu(tmp_path):
    """GPT-2's own activation (gelu_new) becomes --openai-gelu: logits equal transformers' to fp32
    rounding, where the exact erf GELU would be off by far more."""
    hf = hf_gpt2(activation="gelu_new")
    hf.save_pretrained(tmp_path / "hf")
    sd, cfg = import_hf(str(tmp_path / "hf"))
    assert cfg.model.openai_gelu and not cfg.model.squared_relu
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
    exact = (megafab_logits(megafab_model(sd, cfg.model), tokens, VOCAB) - want).abs().max().item()
    cfg.model.openai_gelu = False
    erf = (megafab_logits(megafab_model(sd, cfg.model), tokens, VOCAB) - want).abs().max().item()
    assert exact < 1e-6 and erf > 1e-5, (exact, erf)  # measured: 1.2e-7 vs 7.0e-5


def test_layernorm_1p_exports_as_plain_norms(tmp_path):
    from transformers import AutoModelForCausalLM

    for name in ("gpt2", "llama-gqa"):
        hf = BUILDERS[name]()
        hf.save_pretrained(tmp_path / name)
        sd, cfg = import_hf(str(tmp_path / name))
        tokens = _tokens()
        with torch.no_grad():
            want = hf(tokens).logits
        # the same model trained with --apply-layernorm-1p stores every norm weight minus one
        cfg.model.apply_layernorm_1p = True
        sd_1p = {k: (v - 1 if "layernorm.weight" in k else v) for k, v in sd.items()}
        got = megafab_logits(megafab_model(sd_1p, cfg.model), tokens, VOCAB)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        export_hf(sd_1p, cfg, str(tmp_path / f"{name}-out"))
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{name}-out"), local_files_only=True)
        with torch.no_grad():
            torch.testing.assert_close(reloaded.eval()(tokens).logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant,flag", [("qk_layernorm", "--qk-layernorm"),
                                          ("apply_residual_connection_post_layernorm",
                                           "--apply-residual-connection-post-layernorm")])
def test_variants_hf_cannot_hold_are_refused_by_name(tmp_path, variant, flag):
    for name in ("gpt2", "llama-gqa"):
        hf = BUILDERS[name]()
        hf.save_pretrained(tmp_path / name)
        sd, cfg = import_hf(str(tmp_path / name))
        setattr(cfg.model, variant, True)
        if variant == "qk_layernorm":  # the weights such a model has
            d = cfg.model.kv_channels
            for i in range(cfg.model.num_layers):
                for norm in ("q_layernorm", "k_layernorm"):
                    sd[f"decoder.layers.{i}.self_attention.{norm}.weight"] = torch.ones(d)
                    if cfg.model.normalization == "LayerNorm":
                        sd[f"decoder.layers.{i}.self_attention.{norm}.bias"] = torch.zeros(d)
            megafab_model(sd, cfg.model)  # a consistent megafab state dict
            if name == "llama-gqa":  # Llama with QK-norm is Qwen3 (tests/convert/test_hf_qwen.py)
                assert export_hf(sd, cfg, str(tmp_path / f"{name}-out")) == "qwen3"
                continue
        with pytest.raises(ConversionError, match=flag):
            export_hf(sd, cfg, str(tmp_path / f"{name}-out"))


def test_qkv_packing_is_per_group():
    d, heads, groups = 2, 4, 2
    q = torch.arange(heads * d).float()[:, None] + 100
    k = torch.arange(groups * d).float()[:, None] + 200
    v = torch.arange(groups * d).float()[:, None] + 300
    packed = pack_qkv(q, k, v, groups)[:, 0].tolist()
    # group 0: q heads 0, 1 then k0, v0; group 1: q heads 2, 3 then k1, v1
    assert packed == [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    for a, b in zip(unpack_qkv(pack_qkv(q, k, v, groups), heads, groups), (q, k, v), strict=True):
        assert torch.equal(a, b)


def test_partial_rotary_refused_for_llama(tmp_path):
    hf = hf_llama()
    hf.save_pretrained(tmp_path / "hf")
    sd, cfg = import_hf(str(tmp_path / "hf"))
    cfg.model.rotary_percent = 0.5
    with pytest.raises(ConversionError, match="rotary_percent 0.5"):
        export_hf(sd, cfg, str(tmp_path / "out"))


def test_unknown_model_type_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ConversionError, match="model_type 'bert'"):
        import_hf(str(tmp_path))
