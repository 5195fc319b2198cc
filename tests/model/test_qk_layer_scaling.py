"""--apply-query-key-layer-scaling (megatron-core's): q k^T is scaled down by the layer number inside
the GEMM that forms the 16-bit scores and back up in the fp32 softmax. A whole GPT equals
megatron-core 0.16.1's local spec with the flag in float64 (sinks, through the explicit-softmax path,
and plain SDPA); in fp16, scores beyond fp16's range stay finite with it and equal the float64 result,
where without it they overflow, as in Megatron's unfused kernel."""

from __future__ import annotations

import math
import os

import pytest
import torch

from megafab.distributed.masked_attention import attention
from tests.helpers import mcore
from tests.helpers.mcore_moe import megatron_moe_on_cpu
from tests.helpers.mcore_mtp import exact_cross_entropy
from tests.helpers.tiny import LLAMA_STYLE, batch, reference_model, tiny_config

STYLE = dict(LLAMA_STYLE, rotary_percent=1.0, num_layers=3, apply_query_key_layer_scaling=True)


@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one"])
def test_gpt_with_layer_scaling_equals_megatron_core(monkeypatch, softmax_type):
    from megatron.core import tensor_parallel

    with megatron_moe_on_cpu():
        m = tiny_config(style=STYLE, softmax_type=softmax_type).model
        monkeypatch.setattr(tensor_parallel, "vocab_parallel_cross_entropy", exact_cross_entropy)
        theirs = mcore.gpt_model(m, dtype=torch.float64).double().train()
        assert theirs.decoder.layers[2].self_attention.core_attention.softmax_scale == \
            pytest.approx(1 / (3 * math.sqrt(m.kv_channels)))  # megatron-core applies it: layer 3 of 3
        d = m.kv_channels
        steps = torch.arange(0, d, 2, dtype=torch.float64) / d
        theirs.rotary_pos_emb.inv_freq = 1.0 / (m.rotary_base ** steps)
        mcore.train_step_equals(theirs, reference_model(m), m, *batch(m))


def test_fp16_scores_beyond_range_equal_megatron_cores_unfused_kernel():
    """fp16, layer 4 of 4, off-by-one sinks (megafab's explicit-softmax path), q k^T / sqrt(d) ~ 1e5:
    megatron-core's local DotProductAttention and megafab's attention form the same finite output; the
    same scores without the layer scaling overflow fp16."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    torch.manual_seed(0)
    b, heads, s, d = 1, 2, 4, 16
    q = (158 + torch.rand(b, heads, s, d)).half()
    k = (158 + torch.rand(b, heads, s, d)).half()
    v = torch.randn(b, heads, s, d).half()
    sink = torch.zeros(heads, dtype=torch.half)
    with megatron_moe_on_cpu():
        m = tiny_config(style=dict(STYLE, num_layers=4, num_attention_heads=heads, num_query_groups=heads,
                                   hidden_size=heads * d, kv_channels=d), softmax_type="off-by-one").model
        config = mcore.transformer_config(m, dtype=torch.float16)
        config.fp16 = True
        theirs = DotProductAttention(config, layer_number=4, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self")
        sbhd = [t.permute(2, 0, 1, 3) for t in (q, k, v)]
        want = theirs(*sbhd, mcore.causal_mask(s), attn_mask_type=AttnMaskType.causal)  # [s, b, h d]
    ours = attention(q, k, v, None, sink, layer_scale=4)
    assert torch.isfinite(want).all() and torch.isfinite(ours).all()
    assert torch.equal(ours.permute(2, 0, 1, 3).reshape(s, b, heads * d), want)
    assert not torch.isfinite(attention(q, k, v, None, sink)).all()  # unscaled 16-bit scores overflow


def test_transformer_engine_gets_the_scaling_through_its_variable(monkeypatch):
    """TE takes the layer scaling only from NVTE_APPLY_QK_LAYER_SCALING (megatron-core refuses a
    mismatch): megafab sets it for the flag and refuses a value that contradicts the flag."""
    from megafab.model.attention_backend import attention_backend_problems, set_te_attention_switches

    # the switches write os.environ: a copy here, so nothing leaks into later tests' subprocesses
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")})
    set_te_attention_switches("auto", qk_layer_scaling=True)
    assert os.environ["NVTE_APPLY_QK_LAYER_SCALING"] == "1"
    te = tiny_config(style=STYLE, transformer_impl="transformer_engine")
    assert attention_backend_problems(te, "cuda") == []
    monkeypatch.setenv("NVTE_APPLY_QK_LAYER_SCALING", "0")
    (problem,) = attention_backend_problems(te, "cuda")
    assert problem.startswith("NVTE_APPLY_QK_LAYER_SCALING=0 contradicts --apply-query-key-layer-scaling")
