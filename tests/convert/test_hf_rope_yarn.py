"""HF rope_parameters (yarn, default) -> megafab's YaRN fields compute transformers' DeepSeek-V3 RoPE:
the frequencies, the factor on cos and sin (HF uses mscale only when mscale_all_dim is nonzero too)
and MLA's softmax scale (yarn_mscale(factor, mscale_all_dim)^2 / sqrt(q head)), for the corners where
the two formulas could part: mscale_all_dim 0 with mscale != 1, factor left to max / original,
beta 0 (HF's default 32 / 1), truncate false, factor 1; export writes back what imports to the same."""

import math

import pytest
import torch

from megafab.convert import ConversionError, hf_deepseek_v3, hf_rope_yarn
from megafab.convert.state_dict import finalize_model_config
from megafab.model.rotary import RotaryEmbedding, mla_softmax_scale
from tests.helpers.hf_deepseek_tiny import YARN, deepseek_config

DROP = object()  # the key left out of rope_parameters
CORNERS = {"deepseek": {}, "mscale-without-all-dim": dict(mscale=0.8, mscale_all_dim=0.0),
           "no-mscales": dict(mscale=DROP, mscale_all_dim=DROP),
           "factor-from-lengths": dict(factor=None, original_max_position_embeddings=8, mscale_all_dim=DROP),
           "beta-zero": dict(beta_fast=0, beta_slow=0), "no-truncate": dict(truncate=False),
           "factor-1": dict(factor=1.0), "default-rope": "default"}


def _configs(corner):
    change = CORNERS[corner]
    rope = dict(rope_type="default", rope_theta=5000.0) if change == "default" else \
        {k: v for k, v in {**YARN, **change}.items() if v is not DROP}
    hf = deepseek_config(rope=rope)
    return hf, finalize_model_config(hf_deepseek_v3.from_hf_config(hf.to_dict()))


@pytest.mark.parametrize("corner", sorted(CORNERS))
def test_rope_and_softmax_scale_equal_transformers(corner):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    hf, m = _configs(corner)
    theirs = DeepseekV3RotaryEmbedding(hf)
    ours = RotaryEmbedding.from_model_config(m, "cpu")
    torch.testing.assert_close(ours.inv_freq.float(), theirs.inv_freq, rtol=1e-6, atol=0)
    assert ours.factor == pytest.approx(theirs.attention_scaling, rel=1e-12)
    assert mla_softmax_scale(m) == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)
    if corner == "deepseek":  # the corners are not vacuous: both factors differ from 1
        assert abs(ours.factor - 1) > 1e-3 and abs(mla_softmax_scale(m) * math.sqrt(24) - 1) > 1e-3
    # the export writes rope_parameters that import to the same megafab fields
    back = finalize_model_config(hf_deepseek_v3.from_hf_config(
        {**hf.to_dict(), "rope_parameters": hf_rope_yarn.to_hf(m)}))
    fields = ("rope_type", "rotary_base", "rotary_scaling_factor", "mscale", "mscale_all_dim",
              "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
              "yarn_correction_range_round_to_int")
    assert all(getattr(back, f) == getattr(m, f) for f in fields)


def test_attention_factor_and_partial_rotary_are_refused():
    for extra, field in ((dict(attention_factor=1.2), "attention_factor=1.2"),
                         (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5")):
        c = deepseek_config().to_dict()
        c["rope_parameters"] = {**c["rope_parameters"], **extra}
        with pytest.raises(ConversionError, match=field):
            hf_deepseek_v3.from_hf_config(c)
