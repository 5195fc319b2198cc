"""The MLP activation (model/activations.py) and the gpt-oss flags around it.

- gpt-oss's clamped quick-GEGLU equals transformers' GptOssExperts._apply_gate (its gate/linear
  halves interleaved, megatron-core's packed [gate; linear]) in float64, the clamp biting;
- each feature is in effect in an MoE layer of the same weights: quick_gelu vs SiLU, the clamp, the
  offset, the expert biases (megatron-core's equality is tests/model/moe/test_moe_megatron.py's and,
  dense, tests/model/test_dense_variants_megatron.py's);
- the rules: --quick-geglu with --swiglu, the clamp and the offset without a gated unit, a clamp <= 0;
- --enable-gpt-oss sets the YaRN of Megatron-LM HEAD's ModelOpt builder, over the given RoPE flags
  (and a Megatron checkpoint's args with it compare as YaRN);
- --disable-bf16-reduced-precision-matmul with --bf16 turns torch's cuBLAS flag off when the model
  is built (as megatron-core's TransformerConfig does), and only with --bf16;
- --export-force-local-attention is accepted and announced as no effect.
"""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from megafab.arguments import config_from_args
from megafab.checkpoint.megatron_args import model_arg_mismatches
from megafab.model.activations import MLPActivation, quick_gelu
from megafab.model.moe.settings import MoESettings
from megafab.model.rotary import RotaryEmbedding
from megafab.run.fork_ranks import run_ranks
from tests.helpers.driver import driver_state
from tests.helpers.flags import BASE
from tests.helpers.mcore_moe import GPT_OSS_GLU, HIDDEN, megafab_layer
from tests.helpers.tiny import LLAMA_STYLE, tiny_config


def test_clamped_quick_geglu_equals_transformers_gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=2))
    assert (hf.alpha, hf.limit) == (1.702, 7.0)
    h = torch.randn(64, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 6
    ours = MLPActivation(quick_gelu, gated=True, clamp=7.0, offset=1.0)(h)
    gate, linear = h.chunk(2, dim=-1)
    interleaved = torch.stack((gate, linear), dim=-1).flatten(-2)  # HF: gate at even, linear at odd
    assert (ours - hf._apply_gate(interleaved)).abs().max().item() < 1e-14
    assert (gate > 7).any() and (linear.abs() > 7).any()  # both clamps bite


def _output(layer, seed=3):
    x = torch.randn(8, 2, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return layer(x)[0].detach()


def _with_weights(glu, bias=True, swiglu=False, zero_biases=False):
    """An MoE layer (gpt-oss's experts as `glu` says) with the weights every variant shares."""
    layer = megafab_layer(MoESettings(num_experts=4, moe_router_topk=2), swiglu, torch.float64, bias=bias,
                          glu=glu).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            g = torch.Generator().manual_seed(len(name) + p.numel())
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.0 if zero_biases and "bias" in name
                                                                        else 0.3))
    return layer


def test_each_gpt_oss_feature_changes_the_moe_layer():
    full = _output(_with_weights(GPT_OSS_GLU))
    variants = {"silu gate": _with_weights({**GPT_OSS_GLU, "quick_geglu": False}, swiglu=True),
                "no clamp": _with_weights({**GPT_OSS_GLU, "activation_func_clamp_value": None}),
                "no offset": _with_weights({**GPT_OSS_GLU, "glu_linear_offset": 0.0}),
                "zero biases": _with_weights(GPT_OSS_GLU, zero_biases=True)}
    for what, layer in variants.items():
        assert (_output(layer) - full).abs().max().item() > 1e-3, what
    # the clamp acts on fc1's output with its bias: moving the bias moves what is clamped
    layer = _with_weights(GPT_OSS_GLU)
    h = layer.experts.local_experts[0].linear_fc1(torch.randn(5, HIDDEN, dtype=torch.float64))
    assert (h > GPT_OSS_GLU["activation_func_clamp_value"]).any()


def test_plain_activations_ignore_nothing():
    """Without a gated unit the activation is the function alone (GELU, tanh GELU, relu^2)."""
    h = torch.randn(4, 6, dtype=torch.float64)
    for style, fn in ((dict(), F.gelu), (dict(openai_gelu=True), lambda x: F.gelu(x, approximate="tanh")),
                      (dict(squared_relu=True), lambda x: F.relu(x) ** 2)):
        act = MLPActivation.from_model_config(tiny_config(**style).model)
        assert not act.gated and torch.equal(act(h), fn(h))
    act = MLPActivation.from_model_config(tiny_config(style=LLAMA_STYLE).model)
    assert act.gated and act.fn is F.silu and act.clamp is None and act.offset == 0.0


@pytest.mark.parametrize("flags,message", [
    (dict(swiglu=True, quick_geglu=True), "--swiglu and --quick-geglu each choose the MLP activation"),
    (dict(glu_linear_offset=1.0), "--glu-linear-offset 1.0 acts only on a gated linear unit"),
    (dict(activation_func_clamp_value=7.0), "--activation-func-clamp-value 7.0 acts only on a gated"),
    (dict(quick_geglu=True, activation_func_clamp_value=0.0), "must be finite and greater than zero"),
])
def test_activation_rules(flags, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**flags)


def test_enable_gpt_oss_sets_megatrons_modelopt_yarn():
    flags = BASE + ["--position-embedding-type", "rope", "--rotary-base", "150000", "--enable-gpt-oss"]
    m = config_from_args(flags, world_size=1).model
    assert (m.position_embedding_type, m.rotary_scaling_factor, m.yarn_original_max_position_embeddings,
            m.yarn_beta_fast, m.yarn_beta_slow, m.mscale, m.mscale_all_dim,
            m.yarn_correction_range_round_to_int) == ("yarn", 32.0, 131072, 32.0, 1.0, 1.0, 0.0, False)
    notes = config_from_args(flags, world_size=1).start_up_notes()
    assert any("replaces --position-embedding-type rope" in n and "ModelOpt" in n for n in notes)  # said
    plain = config_from_args(flags[:-1], world_size=1).model
    yarn, rope = (RotaryEmbedding.from_model_config(c, torch.device("cpu")) for c in (m, plain))
    assert yarn.factor > 1.3 and rope.factor == 1.0  # YaRN's attention factor 0.1 ln 32 + 1
    assert not torch.allclose(yarn.inv_freq.double(), rope.inv_freq.double())
    # a Megatron checkpoint of such a run records the flags as given: its args mean YaRN too
    saved = argparse.Namespace(position_embedding_type="rope", enable_gpt_oss=True)
    assert model_arg_mismatches(saved, m) == []
    saved.enable_gpt_oss = False
    assert model_arg_mismatches(saved, m) == ["--position-embedding-type: checkpoint 'rope', this run 'yarn'"]


def _build_sets_flag(rank, world, bf16):
    """torch's flag after driver_state builds the model (training/build.py's build_model)."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    driver_state(tiny_config(bf16=bf16, disable_bf16_reduced_precision_matmul=True), torch.float32)
    return torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction


def test_disable_bf16_reduced_precision_matmul_sets_torchs_flag_with_bf16():
    assert run_ranks(_build_sets_flag, 1, True, timeout=60) == [False]
    assert run_ranks(_build_sets_flag, 1, False, timeout=60) == [True]  # Megatron: with --bf16 only


def test_export_force_local_attention_is_announced_as_no_effect():
    cfg = config_from_args(BASE + ["--export-force-local-attention"], world_size=1)
    assert [n for n in cfg.no_effect if n.startswith("--export-force-local-attention")]
