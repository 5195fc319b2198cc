"""A GPT with Llama 3.x RoPE scaling and position interpolation, one with YaRN for standard
attention (a short original context) and one with interleaved RoPE (--rotary-interleaved, partial
rotary), under TP 2 (with and without SP) and CP 2 (each rank's
positions offset by its chunks), and Qwen2's q/k/v biases without other biases and Qwen3's QK-norm
under TP 2 (+ SP), equal the single-process model in float64: the loss and every gradient within
1e-10; the config rules refuse the RoPE flags where they have no effect."""

from __future__ import annotations

import pytest
import torch

from megafab.config.core import ConfigError
from megafab.distributed.context_parallel import context_parallel_masked_mean, split_for_context_parallel
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.transformer import LayerContext
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import (
    LLAMA_STYLE,
    batch,
    context,
    full_grad,
    reduce_sequence_parallel_grads,
    reference_model,
    tiny_config,
)

STYLE = dict(LLAMA_STYLE, rotary_percent=1.0, rotary_base=500000, use_rope_scaling=True,
             rope_scaling_factor=16.0, rope_scaling_original_max_position_embeddings=64,
             rotary_seq_len_interpolation_factor=2.0)
QKV_BIAS = dict(LLAMA_STYLE, rotary_percent=1.0, add_qkv_bias=True)  # Qwen2's attention
QK_NORM = dict(LLAMA_STYLE, rotary_percent=1.0, qk_layernorm=True)  # Qwen3's attention
YARN = dict(LLAMA_STYLE, rotary_percent=1.0, position_embedding_type="yarn", rotary_scaling_factor=4.0,
            yarn_original_max_position_embeddings=4)  # gpt-oss's RoPE, its original context shorter here
INTERLEAVED = dict(LLAMA_STYLE, rotary_interleaved=True)  # channel pairs (2i, 2i+1), partial rotary


def loss_and_grads(model, tokens, labels, mask, tp_group=None):
    loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    if model.ctx.sequence_parallel:
        reduce_sequence_parallel_grads(model, tp_group)
    for p in model.parameters():  # QK-norm's replicated weights: finalize_model_grads sums them over TP
        if tp_group is not None and getattr(p, "grad_sum_over_tp", False):
            torch.distributed.all_reduce(p.grad, group=tp_group)
    return loss.item(), {n: full_grad(p, tp_group) for n, p in model.named_parameters()}


def _compare(loss, grads, ref_loss, ref_grads):
    assert abs(loss - ref_loss) < 1e-10, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() < 1e-10, name
    return len(grads)


def _tp_parity(rank, world):
    topo = build_topology(tp=world)
    checked = []
    for style in (STYLE, QKV_BIAS, QK_NORM, YARN, INTERLEAVED):
        cfg = tiny_config(tp=world, style=style).model
        tokens, labels, mask = batch(cfg)
        ref = loss_and_grads(reference_model(cfg), tokens, labels, mask)
        assert ("decoder.layers.0.self_attention.linear_qkv.bias" in ref[1]) == cfg.add_qkv_bias
        for sp in (False, True):
            model = GPTModel(cfg, context(topo.group("tp"), sp))
            checked.append(_compare(*loss_and_grads(model, tokens, labels, mask, topo.group("tp")), *ref))
    return checked


def test_rope_scaling_and_qkv_bias_tensor_and_sequence_parallel_equal_single_process():
    checked = run_ranks(_tp_parity, 2, timeout=120)
    assert all(len(c) == 10 and min(c) > 0 for c in checked)


def _cp_parity(rank, world, style):
    topo = build_topology(cp=world)
    cfg = tiny_config(style=style).model
    tokens, labels, mask = batch(cfg)
    ref_loss, ref_grads = loss_and_grads(reference_model(cfg), tokens, labels, mask)
    group = topo.group("cp")
    ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, cp_group=group)
    model = GPTModel(cfg, ctx)

    def local(t):
        return split_for_context_parallel(t, 1, rank, world)

    loss = context_parallel_masked_mean(model(local(tokens), labels=local(labels)), local(mask), group)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        torch.distributed.all_reduce(p.grad, group=group)
        grads[name] = p.grad / world
    return _compare(loss.item(), grads, ref_loss, ref_grads)


@pytest.mark.parametrize("style", [STYLE, YARN, INTERLEAVED],
                         ids=["llama3+interpolation", "yarn", "interleaved"])
def test_rope_scaling_context_parallel_equals_single_process(style):
    assert min(run_ranks(_cp_parity, 2, style, timeout=120)) > 0


@pytest.mark.parametrize("style,plain_style", [
    (STYLE, dict(STYLE, use_rope_scaling=False, rotary_seq_len_interpolation_factor=None)),
    (YARN, dict(YARN, position_embedding_type="rope")),
    (INTERLEAVED, LLAMA_STYLE)], ids=["llama3+interpolation", "yarn", "interleaved"])
def test_scaling_is_in_effect(style, plain_style):
    cfg = tiny_config(style=style).model
    plain = tiny_config(style=plain_style)
    tokens, labels, _ = batch(cfg)
    ours = reference_model(cfg)
    other = reference_model(plain.model)
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (ours(tokens, labels=labels) - other(tokens, labels=labels)).abs().max().item() > 1e-4


@pytest.mark.parametrize("extra,flag", [
    (dict(position_embedding_type="learned_absolute", use_rope_scaling=True), "--use-rope-scaling"),
    (dict(position_embedding_type="yarn", rotary_seq_len_interpolation_factor=2.0),
     "--rotary-seq-len-interpolation-factor"),
    (dict(use_rope_scaling=True, rope_scaling_low_freq_factor=4.0), "--rope-scaling-low-freq-factor 4.0"),
])
def test_flags_without_effect_or_bad_values_are_refused(extra, flag):
    with pytest.raises(ConfigError, match=flag):
        tiny_config(style=dict(LLAMA_STYLE, rotary_percent=1.0, **extra))
