"""The whole GPT under TP x SP equals the single-process model in float64 (loss and every grad)."""

import pytest
import torch

from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import (
    GPT2_STYLE,
    LLAMA_STYLE,
    batch,
    context,
    full_grad,
    reduce_sequence_parallel_grads,
    reference_model,
    tiny_config,
)


def loss_and_grads(model, tokens, labels, mask, tp_group=None):
    loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    if model.ctx.sequence_parallel:
        reduce_sequence_parallel_grads(model, tp_group)
    return loss.item(), {n: full_grad(p, tp_group) for n, p in model.named_parameters()}


def _tp_parity(rank, world):
    topo = build_topology(tp=world)
    torch.manual_seed(99)  # must not matter: init is keyed by (seed, name)
    checked = []
    for style_name, style in (("gpt2", GPT2_STYLE), ("llama", LLAMA_STYLE)):
        overrides = {"num_attention_heads": 8, "num_query_groups": 4} if style is LLAMA_STYLE and world == 4 \
            else {}
        cfg = tiny_config(tp=world, style=style, **overrides).model
        tokens, labels, mask = batch(cfg)
        ref_loss, ref_grads = loss_and_grads(reference_model(cfg), tokens, labels, mask)
        for sp in ([False, True] if world > 1 else [False]):
            model = GPTModel(cfg, context(topo.group("tp"), sp))
            loss, grads = loss_and_grads(model, tokens, labels, mask, topo.group("tp"))
            assert abs(loss - ref_loss) < 1e-10, (style_name, sp, loss, ref_loss)
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                err = (g - ref_grads[name]).abs().max().item()
                assert err < 1e-10, (style_name, sp, name, err)
            checked.append((style_name, sp, len(grads)))
    return checked


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.smoke), 4])
def test_gpt_tensor_and_sequence_parallel_equal_single_process(tp):
    checked = run_ranks(_tp_parity, tp, timeout=120)[0]
    assert len(checked) == (2 if tp == 1 else 4)


@pytest.mark.smoke
def test_parameter_names_follow_megatron_core():
    cfg = tiny_config(style=LLAMA_STYLE).model
    names = set(dict(reference_model(cfg).named_parameters()))
    for expected in ("embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
                     "decoder.layers.0.self_attention.linear_qkv.weight",
                     "decoder.layers.0.self_attention.linear_proj.weight",
                     "decoder.layers.3.pre_mlp_layernorm.weight", "decoder.layers.3.mlp.linear_fc1.weight",
                     "decoder.layers.3.mlp.linear_fc2.weight", "decoder.final_layernorm.weight",
                     "output_layer.weight"):
        assert expected in names, expected
    gpt2 = dict(reference_model(tiny_config().model).named_parameters())
    assert "embedding.position_embeddings.weight" in gpt2 and "output_layer.weight" not in gpt2


def test_init_is_megatron_normal_with_scaled_output_projections():
    cfg = tiny_config(num_layers=8, hidden_size=64, num_attention_heads=4).model
    params = dict(reference_model(cfg).named_parameters())
    qkv = params["decoder.layers.0.self_attention.linear_qkv.weight"]
    proj = params["decoder.layers.0.self_attention.linear_proj.weight"]
    assert abs(qkv.std().item() - 0.02) < 0.002
    assert abs(proj.std().item() - 0.02 / 4.0) < 0.0005  # 0.02 / sqrt(2 * 8)
    assert params["decoder.layers.0.self_attention.linear_qkv.bias"].abs().sum() == 0
