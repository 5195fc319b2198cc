"""Qwen2 / Qwen2.5 (transformers' Qwen2ForCausalLM) <-> megafab: Llama's names and layout (hf_llama.py)
with biases on q, k and v but none on o or the MLP: --disable-bias-linear --add-qkv-bias (the
biases packed per key/value group as the weights are). Sliding-window attention is refused.
"""

from __future__ import annotations

import torch

from megafab.config import ModelConfig
from megafab.convert import hf_llama, hf_moe
from megafab.convert.state_dict import ConversionError

NAME = "Qwen2"


def check_exportable(m: ModelConfig) -> None:
    if not m.add_qkv_bias or m.add_bias_linear:
        raise ConversionError(f"add_qkv_bias {m.add_qkv_bias}, add_bias_linear {m.add_bias_linear}: HF Qwen2 "
                              f"has biases on q, k and v and nowhere else (--disable-bias-linear "
                              f"--add-qkv-bias)")
    hf_llama.check_exportable(m, allow_qkv_bias=True, architecture=NAME)


def to_hf_config(m: ModelConfig, eod: int | None = None, bos: int | None = None):
    from transformers import Qwen2Config

    check_exportable(m)
    return Qwen2Config(**hf_llama.dense_config(m, eod, bos), use_sliding_window=False,
                       architectures=["Qwen2ForCausalLM"])


def from_hf_config(c: dict) -> dict:
    """Flat megafab model fields from a Qwen2 config.json dict."""
    hf_moe.refuse_sliding_window(c, NAME)
    return {**hf_llama.from_hf_config(c), "add_qkv_bias": True}


def to_hf_state_dict(sd: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    check_exportable(m)
    return hf_llama.dense_to_hf(sd, m, NAME)


def from_hf_state_dict(hf: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    return hf_llama.from_hf_state_dict(hf, m, NAME)
