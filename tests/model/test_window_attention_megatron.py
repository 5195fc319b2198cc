"""Sliding-window attention (--window-size, --window-attn-skip-freq) and attention sinks
(--softmax-type off-by-one / learnable) equal megatron-core 0.16.1's local DotProductAttention: a
whole GPT (local spec, GQA, RoPE) in float64 within 1e-12, the per-token loss and every gradient,
the learnable sink `self_attention.core_attention.softmax_offset` included. megatron-core runs both
on CPU once its window mask (get_sliding_window_causal_mask, built on "cuda") is built on the CPU;
its softmax_offset is allocated on torch.cuda.current_device(), which the CPU shims point at the CPU.
Each case also differs from the plain model (the feature is in effect), and KV-cache generation
equals full recompute with a window shorter than the prompt."""

from __future__ import annotations

import pytest
import torch

from megafab.inference.generate import SamplingParams, generate
from megafab.model.core_attention import is_window_layer, window_attention_problems
from tests.helpers import mcore
from tests.helpers.mcore_moe import megatron_moe_on_cpu
from tests.helpers.mcore_mtp import exact_cross_entropy
from tests.helpers.tiny import LLAMA_STYLE, batch, reference_model, tiny_config

STYLE = dict(LLAMA_STYLE, rotary_percent=1.0, num_layers=4)
CASES = {"window": dict(window_size=(3, 0)),
         "window_every_2nd_full": dict(window_size=(5, 0), window_attn_skip_freq=2),
         "window_pattern_learnable": dict(window_size=(2, 0), window_attn_skip_freq=(1, 0, 0, 1),
                                          softmax_type="learnable"),
         "off_by_one": dict(softmax_type="off-by-one"),
         "learnable": dict(softmax_type="learnable"),
         "window_off_by_one_mha": dict(window_size=(4, 0), softmax_type="off-by-one", num_query_groups=4)}


@pytest.fixture(scope="module")
def megatron_cpu():
    from megatron.core.fusions import fused_softmax

    with megatron_moe_on_cpu():
        patch = pytest.MonkeyPatch()
        patch.setattr(fused_softmax, "get_sliding_window_causal_mask", mcore.window_mask_on_cpu)
        yield
        patch.undo()


@pytest.mark.parametrize("case", CASES)
def test_gpt_window_and_sinks_equal_megatron_core(megatron_cpu, monkeypatch, case):
    from megatron.core import tensor_parallel

    m = tiny_config(style=STYLE, **CASES[case]).model
    monkeypatch.setattr(tensor_parallel, "vocab_parallel_cross_entropy", exact_cross_entropy)
    theirs = mcore.gpt_model(m, dtype=torch.float64).double().train()
    d = m.kv_channels  # float64 RoPE frequencies (megatron-core computes float32 ones)
    theirs.rotary_pos_emb.inv_freq = 1.0 / (m.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ours = reference_model(m)
    tokens, labels, mask = batch(m)
    loss = mcore.train_step_equals(theirs, ours, m, tokens, labels, mask)
    # in effect: the plain model with the same weights computes otherwise
    plain = reference_model(tiny_config(style=STYLE, num_query_groups=m.num_query_groups).model)
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if "softmax_offset" not in k})
    assert (plain(tokens, labels=labels) - loss).abs().max().item() > 1e-4


def test_which_layers_are_windowed_is_megatron_cores():
    from megatron.core.transformer.utils import is_layer_window_attention

    for freq in (None, 1, 2, 3, (1, 0, 0, 1), (0, 0, 0, 0)):
        m = tiny_config(style=STYLE, window_size=(3, 0), window_attn_skip_freq=freq).model
        theirs = [is_layer_window_attention((3, 0), mcore._as_list(freq), n + 1) for n in range(4)]
        assert [is_window_layer(m, n) for n in range(4)] == theirs, freq
    m = tiny_config(style=STYLE, window_size=(3, 0), window_attn_skip_freq=4).model
    assert [is_window_layer(m, n) for n in range(4)] == [True, True, True, False]  # gpt-oss: freq 2


@pytest.mark.parametrize("case", ["window_pattern_learnable", "window_off_by_one_mha"])
def test_kv_cache_generation_equals_full_recompute(case):
    m = tiny_config(style=STYLE, **CASES[case]).model
    model = reference_model(m)
    with torch.no_grad():  # sinks large enough to matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    prompt = [5, 17, 3, 99, 42, 8, 23, 61]  # longer than the windows: they cross the prompt
    params = SamplingParams(max_new_tokens=7)
    cached = generate(model, prompt, params, use_kv_cache=True)
    assert cached == generate(model, prompt, params, use_kv_cache=False)
    plain = reference_model(tiny_config(style=STYLE, num_query_groups=m.num_query_groups).model)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "softmax_offset" not in k})
    tokens = torch.tensor([prompt + cached])
    ours, theirs = model(tokens), plain(tokens)
    assert (ours - theirs).abs().max().item() > 1e-3


def test_rules_refuse_what_megafab_cannot_run():
    def problems(**kw):
        cfg = tiny_config(style=STYLE)
        m = cfg.model.replaced(**{k: v for k, v in kw.items() if k in cfg.model.__dataclass_fields__})
        p = cfg.parallel.replaced(**{k: v for k, v in kw.items() if k in cfg.parallel.__dataclass_fields__})
        return " | ".join(window_attention_problems(m, p))

    assert problems(window_size=(3, 0), window_attn_skip_freq=2) == ""
    assert "right side must be 0" in problems(window_size=(3, 2))
    assert "needs --window-size" in problems(window_attn_skip_freq=2)
    assert "3 entries for --num-layers 4" in problems(window_size=(3, 0), window_attn_skip_freq=(1, 0, 1))
    assert "must be at least 1" in problems(window_size=(3, 0), window_attn_skip_freq=0)
    refused = problems(window_size=(3, 0), context_parallel_size=2, cp_comm_type="p2p")
    assert "use --cp-comm-type allgather or a2a" in refused
    assert problems(window_size=(3, 0), context_parallel_size=2, cp_comm_type="allgather") == ""
    assert problems(softmax_type="learnable", context_parallel_size=2, cp_comm_type="p2p") == ""
    assert "--multi-latent-attention" in problems(softmax_type="learnable", multi_latent_attention=True)
    assert problems(window_size=(3, 0), transformer_impl="transformer_engine") == ""  # te_wrap's layer
    assert "--mtp-num-layers" in problems(softmax_type="off-by-one", mtp_num_layers=1)
