"""Tiny random HF GPT-2 / Llama (plain and Llama-3 RoPE) / Qwen2 / Qwen3 models built locally (no
downloads) and megafab models from a full state dict."""

import json

import torch

from megafab.model.gpt import GPTModel
from megafab.model.transformer import LayerContext

VOCAB = 100  # padded to 128 by megafab: the padding rows are exercised


def hf_gpt2(seed=0, tied=True, activation="gelu"):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=48,
                     activation_function=activation, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     layer_norm_epsilon=1e-5, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    _randomize(model)
    return model


def hf_llama(seed=0, groups=2, tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=groups, head_dim=8,
                      max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=5000.0,
                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    _randomize(model)
    return model


# Llama 3's RoPE scaling with a short original context: on 8 channels at base 5000 the wavelengths
# 6, 53, 444 and 3737 are kept, kept, smoothed and divided by the factor (original 512: bands 128-512)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=512)


def hf_dense(family, seed=0, groups=2, tied=False, rope=None, **extra):
    """A tiny random Llama-family model: "llama" (rope: its rope_parameters, default plain RoPE),
    "qwen2" (q/k/v biases), "qwen3" (QK-norm) or "mistral" (extra: sliding_window=W); `extra`: more
    config fields."""
    import transformers

    torch.manual_seed(seed)
    config_class, model_class = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                                 "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    cfg = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=groups, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_parameters=rope or dict(rope_type="default", rope_theta=5000.0), tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2, **extra)
    model = getattr(transformers, model_class)(cfg).eval()
    _randomize(model)
    return model


@torch.no_grad()
def _randomize(model):
    """Norm weights/biases are initialized to 1/0: perturb every tensor so no mix-up can hide."""
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)


def edit_hf_config(path, **changes):
    """Change config.json fields in HF directory `path` (a dict value updates a dict field)."""
    c = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(c.get(key), dict):
            c[key].update(value)
        else:
            c[key] = value
    (path / "config.json").write_text(json.dumps(c))


def megafab_model(sd, model_cfg, dtype=torch.float32):
    model = GPTModel(model_cfg, LayerContext(None, False, dtype, torch.device("cpu"), 1234)).eval()
    model.load_state_dict(sd, strict=True)
    return model


def megafab_logits(model, tokens, vocab_size):
    with torch.no_grad():
        return model(tokens).transpose(0, 1)[..., :vocab_size]  # [b, s, V]
