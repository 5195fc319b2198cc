"""Full activation recompute of MoE layers changes nothing: the router's side effects (the logged
balancing / z losses, the expert-bias token counts, global_aux_loss's running counts) happen once
per micro-batch, and the loss and every gradient equal the model without recompute, also when two
micro-batches are forwarded before either is backpropagated (1F1B's warm-up order)."""

from __future__ import annotations

import pytest
import torch

from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.moe.balancing import LossScale
from megafab.model.moe.router import routers_of
from megafab.model.moe.settings import MoESettings
from megafab.model.transformer import LayerContext
from tests.helpers.tiny import LLAMA_STYLE, batch, tiny_config

SETTINGS = MoESettings(num_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1, 1, 1),
                       moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_load_balancing_type=("aux_loss", "global_aux_loss"),
                       moe_aux_loss_coeff=(1e-2, 2e-2), moe_z_loss_coeff=1e-3,
                       moe_shared_expert_intermediate_size=24, moe_input_jitter_eps=0.1)


def _model(**recompute) -> GPTModel:
    m = tiny_config(style=LLAMA_STYLE, **recompute).model
    ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, moe=SETTINGS,
                       moe_loss_scale=LossScale(0.5))
    return GPTModel(m, ctx)


def _run(model):
    """Two micro-batches forwarded, then both backpropagated; what the routers kept."""
    torch.manual_seed(5)  # the input jitter's draws
    losses = []
    for seed in (0, 1):
        tokens, labels, mask = batch(model.cfg, seed=seed)
        losses.append(masked_mean_loss(model(tokens, labels=labels), mask))
    for loss in losses:
        (loss / 2).backward()
    routers = routers_of([model])
    state = {f"{i}.{name}": value.clone() for i, r in enumerate(routers)
             for name, value in (*r.logged_losses.items(), ("tokens", r.local_tokens_per_expert),
                                 ("global", r.global_tokens_per_expert), ("steps", r.global_steps))}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return [loss.item() for loss in losses], grads, state


@pytest.mark.parametrize("recompute_num_layers", [1, 2])
def test_recomputed_moe_layers_have_their_side_effects_once(recompute_num_layers):
    ref_losses, ref_grads, ref_state = _run(_model())
    assert len(ref_state) == 3 * 6  # 3 MoE layers: 3 logged losses and 3 counters each
    assert all(ref_state[f"{i}.steps"].item() == 2 for i in range(3))
    model = _model(recompute_granularity="full", recompute_method="uniform",
                   recompute_num_layers=recompute_num_layers)
    assert model.recompute.granularity == "full"
    losses, grads, state = _run(model)
    assert losses == pytest.approx(ref_losses, abs=1e-14, rel=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).abs().max().item() < 1e-12, name
    assert state.keys() == ref_state.keys()
    for name, value in state.items():
        assert (value - ref_state[name]).abs().max().item() < 1e-12, name
    assert all(not r._replayed_counts for r in routers_of([model]))  # every recompute replayed
