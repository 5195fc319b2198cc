"""Qwen3 dense (transformers' Qwen3ForCausalLM) <-> megafab: Llama's names and layout (hf_llama.py)
with QK-norm: self_attn.q_norm / k_norm, an RMSNorm over each head's channels of q and k before RoPE,
are --qk-layernorm's q_layernorm / k_layernorm (megafab normalizes before rotating too).
attention_bias (biases on q, k, v and o together) and sliding windows are refused.
"""

from __future__ import annotations

import torch

from megafab.config import ModelConfig
from megafab.convert import hf_llama, hf_moe
from megafab.convert.state_dict import ConversionError

NAME = "Qwen3"


def check_exportable(m: ModelConfig) -> None:
    if not m.qk_layernorm:
        raise ConversionError("qk_layernorm False: HF Qwen3 always normalizes q and k (--qk-layernorm); "
                              "export this model as Llama")
    if m.add_qkv_bias:
        raise ConversionError("add_qkv_bias: HF Qwen3's attention_bias adds biases to q, k, v and o "
                              "together; a model with QKV-only biases cannot be exported as Qwen3")
    hf_llama.check_exportable(m, allow_qk_layernorm=True, architecture=NAME)


def to_hf_config(m: ModelConfig, eod: int | None = None, bos: int | None = None):
    from transformers import Qwen3Config

    check_exportable(m)
    return Qwen3Config(**hf_llama.dense_config(m, eod, bos), attention_bias=False, use_sliding_window=False,
                       architectures=["Qwen3ForCausalLM"])


def from_hf_config(c: dict) -> dict:
    """Flat megafab model fields from a Qwen3 config.json dict."""
    hf_moe.refuse_sliding_window(c, NAME)
    return {**hf_llama.from_hf_config(c), "qk_layernorm": True}


def to_hf_state_dict(sd: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    check_exportable(m)
    return hf_llama.dense_to_hf(sd, m, NAME)


def from_hf_state_dict(hf: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    return hf_llama.from_hf_state_dict(hf, m, NAME)
