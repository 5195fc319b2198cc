"""Llama 3.x RoPE scaling (--use-rope-scaling, --rope-scaling-factor), position interpolation
(--rotary-seq-len-interpolation-factor), Q/K/V biases without other biases (--add-qkv-bias, Qwen2),
QK-norm (--qk-layernorm, Qwen3) and gpt-oss's clamped quick-GEGLU with biases equal megatron-core
0.16.1's: its scaled RoPE frequencies (float32, as it computes them), and a whole GPT (local spec)
in float64 within 1e-12: the per-token loss and every gradient. megatron-core's frequencies are
float32, so the GPT oracle gets float64 ones (its own _apply_scaling run on float64 plain
frequencies). CPU shims: tests/helpers/mcore_moe.py's."""

from __future__ import annotations

import pytest
import torch

from megafab.model.rotary import Llama3Scaling
from tests.helpers import mcore
from tests.helpers.mcore_moe import megatron_moe_on_cpu
from tests.helpers.mcore_mtp import exact_cross_entropy
from tests.helpers.tiny import LLAMA_STYLE, batch, reference_model, tiny_config

# rotary base 500000 on 8 channels: wavelengths 6, 167, 4443 and 118000 (one kept, one kept, one
# smoothed and one divided by the factor with megatron-core's original context 8192)
ROPE = dict(LLAMA_STYLE, rotary_percent=1.0, rotary_base=500000, num_layers=2)
CASES = {"llama3": dict(use_rope_scaling=True, rope_scaling_factor=8.0),
         "interpolation": dict(rotary_seq_len_interpolation_factor=4.0),
         "both": dict(use_rope_scaling=True, rope_scaling_factor=32.0,
                      rotary_seq_len_interpolation_factor=2.0),
         "qkv_bias": dict(add_qkv_bias=True), "qk_norm": dict(qk_layernorm=True),
         "rotary_interleaved": dict(rotary_interleaved=True),
         "qk_norm_gqa1": dict(qk_layernorm=True, num_query_groups=1, use_rope_scaling=True),
         # gpt-oss's dense MLP: clamped quick-GEGLU (the clamp small enough to bite), +1 offset, biases
         "quick_geglu": dict(swiglu=False, quick_geglu=True, activation_func_clamp_value=0.05,
                             glu_linear_offset=1.0, add_bias_linear=True)}
# the model "without the variant" keeps these (the same weights): a plain SwiGLU MLP with biases
PLAIN = {"quick_geglu": dict(swiglu=True, add_bias_linear=True, ffn_hidden_size=128),
         "rotary_interleaved": {}}


@pytest.fixture(scope="module")
def megatron_cpu():
    with megatron_moe_on_cpu():
        yield


def _plain_inv_freq(m) -> torch.Tensor:
    return 1.0 / (m.rotary_base ** (torch.arange(0, m.kv_channels, 2, dtype=torch.float64) / m.kv_channels))


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_scaled_frequencies_equal_megatron_cores(megatron_cpu, factor):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    m = tiny_config(style=ROPE, use_rope_scaling=True, rope_scaling_factor=factor).model
    theirs = RotaryEmbedding(m.kv_channels, 1.0, rotary_base=m.rotary_base, rope_scaling=True,
                             rope_scaling_factor=factor, use_cpu_initialization=True).inv_freq
    ours = Llama3Scaling.from_model_config(m).apply(_plain_inv_freq(m))
    plain = _plain_inv_freq(m)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    # each band is in effect: kept, smoothed, divided by the factor
    assert ours[0] == plain[0] and ours[1] == plain[1]
    assert plain[2] / factor < ours[2] < plain[2]
    assert ours[3].item() == pytest.approx(plain[3].item() / factor, rel=1e-15)


@pytest.mark.parametrize("case", CASES)
def test_gpt_variant_equals_megatron_core(megatron_cpu, monkeypatch, case):
    from megatron.core import tensor_parallel

    m = tiny_config(style=ROPE, **CASES[case]).model
    monkeypatch.setattr(tensor_parallel, "vocab_parallel_cross_entropy", exact_cross_entropy)
    theirs = mcore.gpt_model(m, dtype=torch.float64).double().train()
    emb = theirs.rotary_pos_emb
    plain = _plain_inv_freq(m)
    emb.inv_freq = emb._apply_scaling(plain, factor=m.rope_scaling_factor) if m.use_rope_scaling else plain
    ours = reference_model(m)
    params = dict(ours.named_parameters())
    tokens, labels, mask = batch(m)
    loss = mcore.train_step_equals(theirs, ours, m, tokens, labels, mask)
    # the variant is in effect: the model without it (its extra weights dropped) computes otherwise
    plain_model = reference_model(tiny_config(style=ROPE, num_query_groups=m.num_query_groups,
                                              **PLAIN.get(case, {})).model)
    plain = plain_model.state_dict()
    plain_model.load_state_dict({k: v for k, v in ours.state_dict().items() if k in plain})
    assert len(plain) < len(params) or m.use_rope_scaling or m.rotary_seq_len_interpolation_factor \
        or case in PLAIN
    assert (plain_model(tokens, labels=labels) - loss).abs().max().item() > 1e-5  # llama3 alone: 7e-5
