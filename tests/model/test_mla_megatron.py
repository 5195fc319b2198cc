"""megafab's multi-latent attention layer equals megatron-core 0.16.1's MLASelfAttention (local spec)
for the same weights: the output and every gradient (weights and input), with and without a query
LoRA, with YaRN and with plain RoPE, with and without the latent norms; float64 within 1e-12 and
float32 within 1e-5. The CPU workarounds are tests/helpers/mcore_moe.py's; MLA's are mcore_mla.py's."""

from __future__ import annotations

import math

import pytest
import torch

from megafab.model.mla import MLASelfAttention
from megafab.model.rotary import RotaryEmbedding, Yarn, mla_softmax_scale
from megafab.model.transformer import LayerContext
from tests.helpers.mcore_mla import MLA_STYLE, copy_from_megatron, megatron_forward, megatron_mla
from tests.helpers.mcore_moe import megatron_moe_on_cpu
from tests.helpers.tiny import tiny_config

CASES = {  # name: config overrides
    "q_lora_yarn": {},
    "no_q_lora_yarn": {"q_lora_rank": None},
    "q_lora_rope": {"rope_type": "rope"},
    "no_q_lora_rope_no_norms": {"q_lora_rank": None, "rope_type": "rope", "qk_layernorm": False},
}


@pytest.fixture(scope="module")
def megatron_cpu():
    with megatron_moe_on_cpu():
        yield


def _step(layer, x, megatron: bool, rotary=None):
    x = x.detach().clone().requires_grad_(True)
    if megatron:
        out = megatron_forward(layer, x)
    else:
        positions = torch.arange(x.shape[0]).expand(x.shape[1], -1)
        out = layer(x, rotary(positions, x.dtype))
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), x.grad


# every case in float64; two of them (with and without a query LoRA) in float32 as well
PRECISIONS = [(case, torch.float64, 1e-12) for case in CASES] + \
    [(case, torch.float32, 1e-5) for case in ("q_lora_yarn", "no_q_lora_rope_no_norms")]


@pytest.mark.parametrize("case,dtype,tol", PRECISIONS)
def test_mla_layer_equals_megatron_core(megatron_cpu, case, dtype, tol):
    m = tiny_config(style={**MLA_STYLE, **CASES[case]}).model
    theirs = megatron_mla(m, dtype)
    ctx = LayerContext(None, False, dtype, torch.device("cpu"), 1234)
    ours = MLASelfAttention(m, ctx, "decoder.layers.0.self_attention.")
    copy_from_megatron(theirs, ours)
    assert (ours.q_layernorm is not None) == (m.qk_layernorm and m.q_lora_rank is not None)
    rotary = RotaryEmbedding.from_model_config(m, torch.device("cpu"))
    x = torch.randn(m.seq_length, 2, m.hidden_size, dtype=dtype, generator=torch.Generator().manual_seed(3))
    ref, ref_dx = _step(theirs, x, megatron=True)
    out, dx = _step(ours, x, megatron=False, rotary=rotary)
    scale = max(1.0, ref.abs().max().item())
    assert (ref - out).abs().max().item() < tol * scale
    assert (ref_dx - dx).abs().max().item() < tol * max(1.0, ref_dx.abs().max().item())
    params = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        assert params[name].grad is not None, name
        err = (p.grad - params[name].grad).abs().max().item()
        assert err < tol * max(1.0, p.grad.abs().max().item()), (name, err)


def test_yarn_and_softmax_scale_are_in_effect():
    """The YaRN case differs from plain RoPE (frequencies, attention factor and softmax scale), so the
    oracle above checks them; megatron-core's formulas by hand for the tiny sizes."""
    m = tiny_config(style=MLA_STYLE).model
    yarn = Yarn.from_model_config(m)
    assert yarn is not None and yarn.scale == 4.0
    m_all = 0.1 * 0.707 * math.log(4.0) + 1.0
    assert mla_softmax_scale(m) == pytest.approx(m_all * m_all / math.sqrt(8 + 16), rel=1e-15)
    assert yarn.attention_factor() == pytest.approx((0.1 * math.log(4.0) + 1.0) / m_all, rel=1e-15)
    plain = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    freq = yarn.inv_freq(16, 10000, "cpu")
    ramp = torch.tensor([0, 0, 0, 0.25, 0.5, 0.75, 1, 1], dtype=torch.float64)  # correction range [2, 6]
    assert torch.allclose(freq, plain / 4 * ramp + plain * (1 - ramp), rtol=1e-15, atol=0)
    rope = tiny_config(style={**MLA_STYLE, "rope_type": "rope"}).model
    assert Yarn.from_model_config(rope) is None


def test_standard_attention_with_yarn_equals_megatron_core(megatron_cpu):
    """--position-embedding-type yarn (standard attention): megatron-core's GPTModel YaRN branch,
    its YarnRotaryEmbedding over kv_channels and the attention factor on cos and sin (float64)."""
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megafab.model.transformer import SelfAttention
    from tests.helpers.mcore import transformer_config
    from tests.helpers.mcore_mla import to_float64_rope

    # kv_channels 8, original length 4096: correction range [1, 3], ramp (i - 1) / 2 exact in float32
    m = tiny_config(style=dict(position_embedding_type="yarn", normalization="RMSNorm", swiglu=True,
                               add_bias_linear=False, untie_embeddings_and_output_weights=True),
                    rotary_scaling_factor=8.0, mscale=0.9, mscale_all_dim=0.5).model
    yarn = Yarn.from_model_config(m)
    config = transformer_config(m, torch.float64)
    for name, value in (("rotary_scaling_factor", yarn.scale), ("mscale", yarn.mscale),
                        ("mscale_all_dim", yarn.mscale_all_dim)):
        setattr(config, "yarn_" + name, value)
    theirs = build_module(get_gpt_layer_local_spec(normalization=m.normalization).submodules.self_attention,
                          config=config, layer_number=1).double()
    rope = YarnRotaryEmbedding(m.kv_channels, rotary_base=m.rotary_base, scaling_factor=yarn.scale,
                               original_max_position_embeddings=yarn.original_max_position_embeddings,
                               beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, mscale=yarn.mscale,
                               mscale_all_dim=yarn.mscale_all_dim, use_cpu_initialization=True)
    to_float64_rope(rope, m.rotary_base)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = SelfAttention(m, LayerContext(None, False, torch.float64, torch.device("cpu"), 1), "x.")
    copy_from_megatron(theirs, ours)
    x = torch.randn(m.seq_length, 2, m.hidden_size, dtype=torch.float64, requires_grad=True)
    s = m.seq_length
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    ref = theirs(x, mask, rotary_pos_emb=rope(s)[0])[0]
    ref.sum().backward()
    ref_dx, x.grad = x.grad, None
    rotary = RotaryEmbedding.from_model_config(m, torch.device("cpu"))
    assert rotary.factor != 1.0 and rotary.dim == m.kv_channels
    out = ours(x, rotary(torch.arange(s).expand(2, -1), torch.float64))
    out.sum().backward()
    assert (ref - out).abs().max().item() < 1e-12
    assert (ref_dx - x.grad).abs().max().item() < 1e-12
    params = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        assert (p.grad - params[name].grad).abs().max().item() < 1e-12, name
