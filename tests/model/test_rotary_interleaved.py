"""--rotary-interleaved (megatron-core's rotary_interleaved): frequency i turns the channel pair (2i, 2i+1)
in place; the GPT equals megatron-core's in test_dense_variants_megatron.py and one process under TP /
SP / CP in test_rope_scaling_parallel.py. Here: the rotation itself, megatron-core's refusal of it with
multi-latent attention, and HF export refusing what HF's RoPE cannot express."""

from __future__ import annotations

import pytest
import torch

from megafab.config.core import ConfigError
from megafab.convert import hf_llama
from megafab.convert.state_dict import ConversionError
from megafab.model.rotary import RotaryEmbedding, apply_rotary
from tests.helpers.mcore_mla import MLA_STYLE
from tests.helpers.tiny import LLAMA_STYLE, tiny_config


def test_each_adjacent_pair_turns_by_its_frequency():
    rope = RotaryEmbedding(8, 1.0, 10000, torch.device("cpu"), interleaved=True)
    positions = torch.arange(5)[None]
    cos, sin = rope(positions, torch.float64)
    x = torch.randn(5, 1, 2, 8, dtype=torch.float64)
    out = apply_rotary(x, (cos, sin), interleaved=True)
    angle = positions[0, :, None, None, None].double() * rope.inv_freq  # [s, 1, 1, 4]
    a, b = x[..., 0::2], x[..., 1::2]
    assert torch.allclose(out[..., 0::2], a * angle.cos() - b * angle.sin(), atol=1e-15)
    assert torch.allclose(out[..., 1::2], b * angle.cos() + a * angle.sin(), atol=1e-15)


def test_megatron_cores_rule_with_multi_latent_attention():
    with pytest.raises(ConfigError, match="--rotary-interleaved does not work with --multi-latent-attention"):
        tiny_config(style=MLA_STYLE, rotary_interleaved=True)


def test_hf_export_refuses_interleaved_rope():
    m = tiny_config(style=dict(LLAMA_STYLE, rotary_percent=1.0), rotary_interleaved=True).model
    with pytest.raises(ConversionError, match=r"--rotary-interleaved \(HF Llama rotates channel i with i"):
        hf_llama.check_exportable(m)
