"""Mistral (transformers' MistralForCausalLM) <-> megafab: Llama's names and layout (hf_llama.py) with
sliding-window attention on every layer. HF's sliding_window W (a query sees the W positions ending
at itself) is megafab's --window-size (W-1, 0); no window (null, or one as long as the context) is
plain causal attention. Per-layer windows (--window-attn-skip-freq) and attention sinks are refused:
MistralConfig has one window for all layers and no sinks.
"""

from __future__ import annotations

import torch

from megafab.config import ModelConfig
from megafab.convert import hf_llama
from megafab.convert.state_dict import ConversionError

NAME = "Mistral"


def window_of(m: ModelConfig) -> int | None:
    """HF's sliding_window of model config `m` (None: full causal attention)."""
    if m.window_size is None or m.window_size[0] < 0:
        return None
    return m.window_size[0] + 1


def check_exportable(m: ModelConfig) -> None:
    if m.window_attn_skip_freq is not None:
        raise ConversionError(f"--window-attn-skip-freq {m.window_attn_skip_freq}: HF Mistral applies its "
                              f"sliding window on every layer; a model with full-attention layers cannot be "
                              f"exported as Mistral")
    if m.window_size is not None and m.window_size[1] != 0:
        raise ConversionError(f"--window-size {m.window_size}: HF Mistral's window is causal (right 0)")
    hf_llama.check_exportable(m, allow_window=True, architecture=NAME)


def to_hf_config(m: ModelConfig, eod: int | None = None, bos: int | None = None):
    from transformers import MistralConfig

    check_exportable(m)
    return MistralConfig(**hf_llama.dense_config(m, eod, bos), sliding_window=window_of(m),
                         architectures=["MistralForCausalLM"])


def from_hf_config(c: dict) -> dict:
    """Flat megafab model fields from a Mistral config.json dict."""
    flat = hf_llama.from_hf_config(c)
    window = c.get("sliding_window")
    if window is not None and window < c["max_position_embeddings"]:
        if window < 1:
            raise ConversionError(f"config.json sliding_window {window}: a window holds at least the query")
        flat["window_size"] = (window - 1, 0)
    return flat


def to_hf_state_dict(sd: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    check_exportable(m)
    return hf_llama.dense_to_hf(sd, m, NAME)


def from_hf_state_dict(hf: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    return hf_llama.from_hf_state_dict(hf, m, NAME)
