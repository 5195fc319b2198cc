"""Llama (transformers' LlamaForCausalLM) <-> megafab.

Traps: q/k/v are separate in HF and packed per key/value group in megafab ([q_1..q_n, k, v] per
group; HF's repeat_kv gives query head j the kv head j // n, the same grouping); gate/up are
separate in HF and packed [gate; up] in megafab's fc1; the vocabulary is padded in megafab; RoPE
must rotate every channel (HF Llama has no partial rotary) with the same base, rotate-half
convention on both sides; HF's rope_type llama3 is --use-rope-scaling with its four values, linear
is --rotary-seq-len-interpolation-factor. Qwen2 / Qwen3 (hf_qwen2.py, hf_qwen3.py) share these
names, with q/k/v biases (--add-qkv-bias) or QK-norm (--qk-layernorm).
"""

from __future__ import annotations

import torch

from megafab.config import ModelConfig
from megafab.convert.state_dict import (
    FINAL_NORM,
    OUTPUT_LAYER,
    WORD_EMBEDDING,
    ConversionError,
    check_keys,
    expected_keys,
    hf_variant_problems,
    layer_prefix,
    pack_qkv,
    pad_vocab,
    plain_norm_weights,
    unpack_qkv,
    unpad_vocab,
)
from megafab.progress import progress

_ATTENTION_SAME = {"self_attn.o_proj.weight": "self_attention.linear_proj.weight",
                   "input_layernorm.weight": "input_layernorm.weight",
                   "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"}
_QK_NORMS = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",  # Qwen3's QK-norm
             "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")  # Qwen2's
_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some old checkpoints saved

HF_LAYERS = "model.layers."  # HF's numbered layers: model.layers.<i>.<name>


def check_exportable(m: ModelConfig, allow_qk_layernorm: bool = False, allow_qkv_bias: bool = False,
                     architecture: str = "Llama", allow_window: bool = False) -> None:
    """allow_qk_layernorm: for Qwen3's Llama-family attention, which has q/k norms; allow_qkv_bias:
    Qwen2's, which has q/k/v biases; allow_window: Mistral's, which has a sliding window."""
    problems = [p for p in hf_variant_problems(m, architecture)
                if not (allow_qk_layernorm and p.startswith("--qk-layernorm"))
                and not (allow_window and p.startswith("--window-size"))]
    if problems:
        raise ConversionError(f"HF {architecture} cannot express {', '.join(problems)}; this model cannot "
                              f"be exported")
    rope_to_hf(m)  # refuses what HF's rope_parameters cannot express
    if m.rotary_percent != 1.0:
        raise ConversionError(f"rotary_percent {m.rotary_percent}: HF Llama rotates every channel of a head "
                              f"(no partial rotary); only models trained with --rotary-percent 1.0 export "
                              f"as Llama")
    if m.add_qkv_bias and not allow_qkv_bias:
        raise ConversionError("add_qkv_bias: HF Llama's attention_bias adds biases to q, k, v and o "
                              "together; a model with QKV-only biases cannot be exported as Llama")


def to_hf_config(m: ModelConfig, eod: int | None = None, bos: int | None = None):
    """The transformers LlamaConfig of megafab model config `m` (true vocabulary size)."""
    from transformers import LlamaConfig

    check_exportable(m)
    return LlamaConfig(**dense_config(m, eod, bos), attention_bias=False, mlp_bias=False,
                       architectures=["LlamaForCausalLM"])


def dense_config(m: ModelConfig, eod: int | None, bos: int | None) -> dict:
    """The config.json fields a Llama-layout model (Llama, Qwen2, Qwen3) shares, from model config `m`."""
    return dict(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, head_dim=m.kv_channels, hidden_act="silu",
        max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.norm_epsilon,
        rope_parameters=rope_to_hf(m), attention_dropout=m.attention_dropout,
        initializer_range=m.init_method_std, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        bos_token_id=bos, eos_token_id=eod)


def rope_to_hf(m: ModelConfig) -> dict:
    """HF's rope_parameters of model config `m`: default, llama3 (--use-rope-scaling) or linear
    (--rotary-seq-len-interpolation-factor)."""
    out = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.use_rope_scaling and m.rotary_seq_len_interpolation_factor is not None:
        raise ConversionError("--use-rope-scaling with --rotary-seq-len-interpolation-factor: HF's "
                              "rope_parameters hold one rope_type (llama3 or linear), not both")
    if m.use_rope_scaling:
        out.update(rope_type="llama3", factor=m.rope_scaling_factor,
                   low_freq_factor=m.rope_scaling_low_freq_factor,
                   high_freq_factor=m.rope_scaling_high_freq_factor,
                   original_max_position_embeddings=m.rope_scaling_original_max_position_embeddings)
    elif m.rotary_seq_len_interpolation_factor is not None:
        out.update(rope_type="linear", factor=float(m.rotary_seq_len_interpolation_factor))
    return out


def rope_from_hf(c: dict) -> dict:
    """megafab's RoPE fields of a config.json's rope_parameters (or rope_scaling + rope_theta)."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    kind = rope.pop("rope_type", rope.pop("type", "default")) or "default"
    theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise ConversionError(f"rope_theta {theta} is not an integer; megafab's --rotary-base is an int")
    out = dict(rotary_base=int(theta))
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    if kind == "llama3":
        missing = [k for k in _LLAMA3 if k not in rope]
        if missing:
            raise ConversionError(f"config.json rope_type llama3 without {', '.join(missing)}")
        out.update(use_rope_scaling=True, rope_scaling_factor=float(rope.pop("factor")),
                   rope_scaling_low_freq_factor=float(rope.pop("low_freq_factor")),
                   rope_scaling_high_freq_factor=float(rope.pop("high_freq_factor")),
                   rope_scaling_original_max_position_embeddings=int(
                       rope.pop("original_max_position_embeddings")))
    elif kind == "linear":
        out.update(rotary_seq_len_interpolation_factor=float(rope.pop("factor")))
    elif kind != "default":
        raise ConversionError(f"config.json uses RoPE scaling {kind!r}; megafab imports rope_type default, "
                              f"llama3 (--use-rope-scaling) and linear "
                              f"(--rotary-seq-len-interpolation-factor)")
    if rope:
        extra = ", ".join(f"{k}={v!r}" for k, v in rope.items())
        raise ConversionError(f"config.json's RoPE {kind} has {extra}, which megafab does not reproduce")
    return out


def from_hf_config(c: dict) -> dict:
    """Flat megafab model fields from a Llama config.json dict."""
    if c.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json hidden_act {c['hidden_act']!r}: megafab's SwiGLU uses SiLU")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ConversionError("config.json has attention_bias/mlp_bias; megafab's Llama layers have no "
                              "biases (--disable-bias-linear)")
    h, heads = c["hidden_size"], c["num_attention_heads"]
    groups = c.get("num_key_value_heads") or heads
    return dict(**rope_from_hf(c), num_layers=c["num_hidden_layers"], hidden_size=h,
                num_attention_heads=heads,
                ffn_hidden_size=c["intermediate_size"], kv_channels=c.get("head_dim") or h // heads,
                group_query_attention=groups != heads, num_query_groups=groups,
                max_position_embeddings=c["max_position_embeddings"],
                seq_length=c["max_position_embeddings"], position_embedding_type="rope",
                rotary_percent=1.0, normalization="RMSNorm",
                norm_epsilon=c.get("rms_norm_eps", 1e-6), swiglu=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
                hidden_dropout=0.0, attention_dropout=c.get("attention_dropout", 0.0),
                init_method_std=c.get("initializer_range", 0.02), vocab_size=c["vocab_size"])


def to_hf_state_dict(sd: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Full megafab state dict -> LlamaForCausalLM state dict (no lm_head when tied)."""
    check_exportable(m)
    return dense_to_hf(sd, m)


def dense_to_hf(sd: dict[str, torch.Tensor], m: ModelConfig, name: str = "Llama") -> dict[str, torch.Tensor]:
    """to_hf_state_dict of a dense Llama-family model whose config was checked exportable."""
    check_keys(sd, expected_keys(m), "the megafab state dict")
    sd = plain_norm_weights(sd, m)
    out = base_to_hf(sd, m)
    for i in progress(range(m.num_layers), desc=f"export to HF {name}", unit="layer"):
        src, dst = layer_prefix(i), layer_prefix(i, HF_LAYERS)
        out.update(attention_to_hf(sd, src, dst, m))
        out.update(dense_mlp_to_hf(sd, src, dst))
    return out


def base_to_hf(sd: dict, m: ModelConfig) -> dict:
    """Embedding, final norm and untied lm_head (true vocabulary rows)."""
    out = {"model.embed_tokens.weight": unpad_vocab(sd[WORD_EMBEDDING], m.vocab_size),
           "model.norm.weight": sd[FINAL_NORM + ".weight"]}
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = unpad_vocab(sd[OUTPUT_LAYER], m.vocab_size)
    return out


def base_from_hf(hf: dict, m: ModelConfig) -> dict:
    """Inverse of base_to_hf (the vocabulary padded)."""
    sd = {WORD_EMBEDDING: pad_vocab(hf["model.embed_tokens.weight"], m.padded_vocab_size),
          FINAL_NORM + ".weight": hf["model.norm.weight"]}
    if m.untie_embeddings_and_output_weights:
        sd[OUTPUT_LAYER] = pad_vocab(hf["lm_head.weight"], m.padded_vocab_size)
    return sd


def hf_weights(hf: dict, m: ModelConfig) -> dict:
    """The HF tensors a conversion reads: without buffers old checkpoints saved and a tied lm_head."""
    hf = {k: v for k, v in hf.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if not m.untie_embeddings_and_output_weights:
        hf.pop("lm_head.weight", None)
    return hf


def attention_to_hf(sd: dict, src: str, dst: str, m: ModelConfig) -> dict:
    """One layer's attention and norms, megafab (prefix src) -> HF Llama-family names (prefix dst);
    Qwen3's q_norm / k_norm with --qk-layernorm."""
    q, k, v = unpack_qkv(sd[src + "self_attention.linear_qkv.weight"], m.num_attention_heads,
                         m.num_query_groups)
    out = {dst + name: t for name, t in zip(_QKV, (q, k, v))}
    if m.add_qkv_bias:
        biases = unpack_qkv(sd[src + "self_attention.linear_qkv.bias"], m.num_attention_heads,
                            m.num_query_groups)
        out.update({dst + name: t for name, t in zip(_QKV_BIAS, biases)})
    same = {**_ATTENTION_SAME, **(_QK_NORMS if m.qk_layernorm else {})}
    out.update({dst + hf_name: sd[src + mf] for hf_name, mf in same.items()})
    return out


def dense_mlp_to_hf(sd: dict, src: str, dst: str) -> dict:
    gate, up = sd[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
    return {dst + DENSE_MLP[0]: gate.contiguous(), dst + DENSE_MLP[1]: up.contiguous(),
            dst + DENSE_MLP[2]: sd[src + "mlp.linear_fc2.weight"]}


def attention_hf_names(m: ModelConfig) -> list[str]:
    return [*_QKV, *(_QKV_BIAS if m.add_qkv_bias else ()), *_ATTENTION_SAME,
            *(_QK_NORMS if m.qk_layernorm else ())]


def attention_from_hf(hf: dict, src: str, dst: str, m: ModelConfig) -> dict:
    """Inverse of attention_to_hf."""
    q, k, v = (hf[src + name] for name in _QKV)
    out = {dst + "self_attention.linear_qkv.weight": pack_qkv(q, k, v, m.num_query_groups).contiguous()}
    if m.add_qkv_bias:
        qb, kb, vb = (hf[src + name] for name in _QKV_BIAS)
        out[dst + "self_attention.linear_qkv.bias"] = pack_qkv(qb, kb, vb, m.num_query_groups).contiguous()
    same = {**_ATTENTION_SAME, **(_QK_NORMS if m.qk_layernorm else {})}
    out.update({dst + mf: hf[src + hf_name] for hf_name, mf in same.items()})
    return out


def dense_mlp_from_hf(hf: dict, src: str, dst: str) -> dict:
    gate, up, down = (hf[src + name] for name in DENSE_MLP)
    return {dst + "mlp.linear_fc1.weight": torch.cat([gate, up]), dst + "mlp.linear_fc2.weight": down}


def hf_expected_keys(m: ModelConfig) -> set[str]:
    keys = hf_base_keys(m)
    for i in range(m.num_layers):
        keys.update(layer_prefix(i, HF_LAYERS) + n for n in [*attention_hf_names(m), *DENSE_MLP])
    return keys


def hf_base_keys(m: ModelConfig) -> set[str]:
    """The keys outside the layers: embedding, final norm, the untied lm_head."""
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if m.untie_embeddings_and_output_weights:
        keys.add("lm_head.weight")
    return keys


def from_hf_state_dict(hf: dict[str, torch.Tensor], m: ModelConfig,
                       name: str = "Llama") -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict -> full megafab state dict (vocabulary padded); Qwen2's and
    Qwen3's alike (`name` in messages)."""
    hf = hf_weights(hf, m)
    check_keys(hf, hf_expected_keys(m), f"the HF {name} weights")
    sd = base_from_hf(hf, m)
    for i in progress(range(m.num_layers), desc=f"import from HF {name}", unit="layer"):
        src, dst = layer_prefix(i, HF_LAYERS), layer_prefix(i)
        sd.update(attention_from_hf(hf, src, dst, m))
        sd.update(dense_mlp_from_hf(hf, src, dst))
    return sd
