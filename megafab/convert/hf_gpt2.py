"""GPT-2 (transformers' GPT2LMHeadModel) <-> megafab.

Traps: HF GPT-2 uses Conv1D, weights stored [in, out] (megafab: torch's [out, in]); c_attn holds
[q | k | v] for all heads, megafab packs per head [q_i, k_i, v_i]; HF's vocabulary is the true one,
megafab's is padded; GPT-2's default activation "gelu_new" is the tanh approximation, megafab's
--openai-gelu ("gelu" is the exact erf GELU, megafab's default; "relu2" is --squared-relu).
"""

from __future__ import annotations

import torch

from megafab.config import ModelConfig
from megafab.convert.state_dict import (
    FINAL_NORM,
    OUTPUT_LAYER,
    POSITION_EMBEDDING,
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

EXACT_GELU = ("gelu",)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # one formula: megafab's --openai-gelu
SQUARED_RELU = "relu2"
# HF layer-relative name -> megafab layer-relative name, for the tensors that only need a transpose
# (Conv1D) or nothing (norms).
_CONV1D = {"attn.c_proj": "self_attention.linear_proj", "mlp.c_fc": "mlp.linear_fc1",
           "mlp.c_proj": "mlp.linear_fc2"}
_NORMS = {"ln_1": "input_layernorm", "ln_2": "pre_mlp_layernorm"}
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old checkpoints

HF_LAYERS = "transformer.h."  # HF's numbered layers: transformer.h.<i>.<name>


def check_exportable(m: ModelConfig) -> None:
    problems = hf_variant_problems(m, "GPT-2")
    if m.num_query_groups != m.num_attention_heads:
        problems.append(f"grouped-query attention (num_query_groups {m.num_query_groups})")
    if m.kv_channels * m.num_attention_heads != m.hidden_size:
        problems.append(f"kv_channels {m.kv_channels} x heads {m.num_attention_heads} != hidden_size "
                        f"{m.hidden_size}")
    if problems:
        raise ConversionError(f"HF GPT-2 cannot express {', '.join(problems)}; export this model as Llama "
                              f"or train it without these options")


def to_hf_config(m: ModelConfig, eod: int | None = None):
    """The transformers GPT2Config of megafab model config `m` (true vocabulary size)."""
    from transformers import GPT2Config

    check_exportable(m)
    return GPT2Config(
        vocab_size=m.vocab_size, n_positions=m.max_position_embeddings, n_embd=m.hidden_size,
        n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size,
        activation_function=hf_activation(m), resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout,
        attn_pdrop=m.attention_dropout, layer_norm_epsilon=m.norm_epsilon,
        initializer_range=m.init_method_std, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        bos_token_id=eod, eos_token_id=eod, architectures=["GPT2LMHeadModel"])


def hf_activation(m: ModelConfig) -> str:
    """The HF activation_function of megafab's MLP activation."""
    return SQUARED_RELU if m.squared_relu else "gelu_new" if m.openai_gelu else "gelu"


def from_hf_config(c: dict) -> dict:
    """Flat megafab model fields from a GPT-2 config.json dict."""
    act = c.get("activation_function", "gelu_new")
    if act not in TANH_GELU + EXACT_GELU + (SQUARED_RELU,):
        raise ConversionError(f"config.json activation_function {act!r}: megafab's GPT-2 MLP has gelu, its "
                              f"tanh approximation (gelu_new, --openai-gelu) or relu2 (--squared-relu); "
                              f"other activations cannot be imported")
    if c.get("scale_attn_by_inverse_layer_idx") or not c.get("scale_attn_weights", True):
        raise ConversionError("config.json changes GPT-2's attention scaling (scale_attn_by_inverse_"
                              "layer_idx/scale_attn_weights); megafab scales by 1/sqrt(head_dim) only")
    h, heads = c["n_embd"], c["n_head"]
    return dict(num_layers=c["n_layer"], hidden_size=h, num_attention_heads=heads,
                ffn_hidden_size=c.get("n_inner") or 4 * h, kv_channels=h // heads,
                max_position_embeddings=c["n_positions"], seq_length=c["n_positions"],
                position_embedding_type="learned_absolute", normalization="LayerNorm",
                norm_epsilon=c.get("layer_norm_epsilon", 1e-5), swiglu=False, add_bias_linear=True,
                untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
                hidden_dropout=c.get("resid_pdrop", 0.1), attention_dropout=c.get("attn_pdrop", 0.1),
                init_method_std=c.get("initializer_range", 0.02), vocab_size=c["vocab_size"],
                openai_gelu=act in TANH_GELU, squared_relu=act == SQUARED_RELU)


def to_hf_state_dict(sd: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Full megafab state dict -> GPT2LMHeadModel state dict (no lm_head when tied)."""
    check_exportable(m)
    check_keys(sd, expected_keys(m), "the megafab state dict")
    sd = plain_norm_weights(sd, m)
    out = {"transformer.wte.weight": unpad_vocab(sd[WORD_EMBEDDING], m.vocab_size),
           "transformer.wpe.weight": sd[POSITION_EMBEDDING],
           "transformer.ln_f.weight": sd[FINAL_NORM + ".weight"],
           "transformer.ln_f.bias": sd[FINAL_NORM + ".bias"]}
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = unpad_vocab(sd[OUTPUT_LAYER], m.vocab_size)
    heads = m.num_attention_heads
    for i in progress(range(m.num_layers), desc="export to HF GPT-2", unit="layer"):
        src, dst = layer_prefix(i), layer_prefix(i, HF_LAYERS)
        for kind in ("weight", "bias"):
            qkv = unpack_qkv(sd[f"{src}self_attention.linear_qkv.{kind}"], heads, heads)
            packed = torch.cat(qkv)  # [3h(, h)] = [q | k | v]
            out[f"{dst}attn.c_attn.{kind}"] = packed.t().contiguous() if kind == "weight" else packed
            for hf, mf in _CONV1D.items():
                t = sd[f"{src}{mf}.{kind}"]
                out[f"{dst}{hf}.{kind}"] = t.t().contiguous() if kind == "weight" else t
            for hf, mf in _NORMS.items():
                out[f"{dst}{hf}.{kind}"] = sd[f"{src}{mf}.{kind}"]
    return out


def normalize_hf_keys(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept GPT2Model-style keys (no `transformer.` prefix) and drop causal-mask buffers."""
    out = {}
    for k, v in hf.items():
        if k.endswith(_IGNORED_SUFFIXES):
            continue
        out[k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k] = v
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state dict -> full megafab state dict (vocabulary padded)."""
    hf = normalize_hf_keys(hf)
    if not m.untie_embeddings_and_output_weights:
        hf.pop("lm_head.weight", None)  # a tied copy some checkpoints store
    expected = to_hf_expected_keys(m)
    check_keys(hf, expected, "the HF GPT-2 weights")
    sd = {WORD_EMBEDDING: pad_vocab(hf["transformer.wte.weight"], m.padded_vocab_size),
          POSITION_EMBEDDING: hf["transformer.wpe.weight"],
          FINAL_NORM + ".weight": hf["transformer.ln_f.weight"],
          FINAL_NORM + ".bias": hf["transformer.ln_f.bias"]}
    if m.untie_embeddings_and_output_weights:
        sd[OUTPUT_LAYER] = pad_vocab(hf["lm_head.weight"], m.padded_vocab_size)
    heads = m.num_attention_heads
    for i in progress(range(m.num_layers), desc="import from HF GPT-2", unit="layer"):
        src, dst = layer_prefix(i, HF_LAYERS), layer_prefix(i)
        for kind in ("weight", "bias"):
            c_attn = hf[f"{src}attn.c_attn.{kind}"]
            packed = c_attn.t() if kind == "weight" else c_attn  # [3h(, h)]
            q, k, v = packed.chunk(3, dim=0)
            sd[f"{dst}self_attention.linear_qkv.{kind}"] = pack_qkv(q, k, v, heads).contiguous()
            for hf_name, mf in _CONV1D.items():
                t = hf[f"{src}{hf_name}.{kind}"]
                sd[f"{dst}{mf}.{kind}"] = t.t().contiguous() if kind == "weight" else t
            for hf_name, mf in _NORMS.items():
                sd[f"{dst}{mf}.{kind}"] = hf[f"{src}{hf_name}.{kind}"]
    return sd


def to_hf_expected_keys(m: ModelConfig) -> set[str]:
    keys = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
            "transformer.ln_f.bias"}
    if m.untie_embeddings_and_output_weights:
        keys.add("lm_head.weight")
    for i in range(m.num_layers):
        for name in ("attn.c_attn", *_CONV1D, *_NORMS):
            keys.update(f"{layer_prefix(i, HF_LAYERS)}{name}.{kind}" for kind in ("weight", "bias"))
    return keys
