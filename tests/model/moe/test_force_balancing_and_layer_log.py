"""--moe-router-force-load-balancing routes on standard-normal logits (megatron-core's RandomSTE: the
gate's gradient passed straight through), spreading tokens evenly whatever the gate prefers, also
with group-limited routing and under recompute; --moe-per-layer-logging's per-layer values
(moe/<name>_layer_<i>) add up to the logged ones; --enable-experimental is accepted (no effect:
megatron-core gates only GPU fused kernels behind it)."""

from __future__ import annotations

import pytest
import torch

from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.moe.layer import log_layer_index
from megafab.model.moe.loss_logging import moe_loss_values
from megafab.model.moe.router import TopKRouter, routers_of
from megafab.model.moe.routing import random_logits
from megafab.model.moe.settings import MoESettings
from megafab.model.transformer import LayerContext
from tests.helpers.tiny import LLAMA_STYLE, batch, tiny_config

H, E = 16, 8


def _router(**settings) -> TopKRouter:
    router = TopKRouter(MoESettings(num_experts=E, **settings), H, init_method_std=0.02, seed=3,
                        prefix="decoder.layers.0.mlp.router.", params_dtype=torch.float32)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0] = 5.0  # the gate sends every token to expert 0 (and its neighbours' ties)
    return router


@pytest.mark.parametrize("groups", [{}, dict(moe_router_num_groups=4, moe_router_group_topk=2)],
                         ids=["topk", "group-limited"])
def test_forced_routing_is_uniform_whatever_the_gate_says(groups):
    x = torch.rand(512, 8, H) + 0.5  # positive: the gate's logit of expert 0 dominates
    common = dict(moe_router_topk=2, moe_router_score_function="sigmoid", **groups)
    _, gate_map = _router(**common)(x)
    assert gate_map[:, 0].all()  # without forcing: expert 0 for every token
    router = _router(moe_router_force_load_balancing=True, **common)
    torch.manual_seed(0)
    probs, forced_map = router(x.requires_grad_())
    counts = forced_map.sum(0).double()
    tokens = x.shape[0] * x.shape[1]
    assert counts.sum() == 2 * tokens
    assert (counts - 2 * tokens / E).abs().max() < 0.1 * 2 * tokens / E, counts  # each expert ~1/E
    probs.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0  # straight through
    torch.manual_seed(0)
    again = _router(moe_router_force_load_balancing=True, **common)(x)[1]
    assert torch.equal(again, forced_map)  # the same seed, the same routing
    other_rank = _router(moe_router_force_load_balancing=True, **common)
    other_rank.random_offset = 100  # EP rank 1 (megatron-core's expert-parallel seed: + 100 per EP rank)
    torch.manual_seed(0)
    assert not torch.equal(other_rank(x)[1], forced_map)


def test_random_logits_are_standard_normal_and_pass_the_gradient_through():
    logits = torch.zeros(20000, 4, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(1)
    drawn = random_logits(logits)
    assert drawn.dtype == torch.float64
    assert abs(drawn.mean().item()) < 0.02 and abs(drawn.std().item() - 1) < 0.02
    weight = torch.randn_like(drawn)
    (drawn * weight).sum().backward()
    assert torch.equal(logits.grad, weight)


MOE = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1, 1, 1], moe_router_score_function="sigmoid",
           moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[1e-2], moe_z_loss_coeff=1e-3,
           moe_router_force_load_balancing=True, moe_per_layer_logging=True)


def _run(**recompute):
    cfg = tiny_config(style=LLAMA_STYLE, **MOE, **recompute)
    ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, moe=cfg.moe)
    model = GPTModel(cfg.model, ctx)
    torch.manual_seed(7)
    tokens, labels, mask = batch(cfg.model)
    loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    return cfg, model, loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_forced_routing_replays_under_recompute_and_logs_each_layer():
    cfg, model, loss, grads = _run()
    for recompute in (dict(recompute_granularity="selective", recompute_modules=["moe"]),
                      dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        _, _, loss2, grads2 = _run(**recompute)
        assert loss2 == loss and all(torch.equal(grads2[n], g) for n, g in grads.items()), recompute
    routers = routers_of([model])
    assert [r.log_layer for r in routers] == [1, 2, 3]
    values = moe_loss_values(cfg.moe, routers, num_moe_layers=3, num_micro_batches=2, per_layer=4)
    names = ("load_balancing_loss", "z_loss")
    assert set(values) == {*names} | {f"moe/{n}_layer_{i}" for n in names for i in range(4)}
    for name in ("load_balancing_loss", "z_loss"):
        layers = [values[f"moe/{name}_layer_{i}"] for i in range(4)]
        assert layers[0] == 0 and all(v > 0 for v in layers[1:])  # layer 0 is dense
        assert sum(layers) / 3 == pytest.approx(values[name], rel=1e-12)


def test_log_layer_index_follows_megatrons_tracker():
    assert log_layer_index("decoder.layers.5.mlp.", 8) == 5
    assert log_layer_index("mtp.layers.0.transformer_layer.mlp.", 8) == 8
    assert log_layer_index("experts.", 8) is None


def test_enable_experimental_is_accepted_and_announced_as_changing_nothing():
    from megafab.arguments import config_from_args
    from tests.helpers.flags import tiny_flags

    base = tiny_flags(num_layers=2) + ["--micro-batch-size", "1", "--train-iters", "1", "--mock-data",
                                       "--vocab-size", "64", "--lr", "1e-3"]
    cfg = config_from_args(base + ["--enable-experimental"], world_size=1)
    notes = [note for note in cfg.no_effect if "--enable-experimental" in note]
    assert notes and "fused token-permutation" in notes[0]
