"""--moe-router-load-balancing-type sinkhorn equals megatron-core 0.16.1's for the same weights and
input: the router's probs and routing map, then the whole MoE layer's output, input gradient and
every parameter gradient, in training (the Sinkhorn choice) and in eval (plain top-k), top-1
(sigmoid scores) and top-2 (softmax), both dispatchers; float64 within 1e-12 (the Sinkhorn iteration
itself runs in float32 in both), float32 with an fp32 / fp64 router within 1e-5. The training choice
is checked to differ from the eval one, so the Sinkhorn step is not vacuous."""

from __future__ import annotations

import pytest
import torch

from megafab.model.moe.settings import MoESettings
from megafab.model.moe.sinkhorn import sinkhorn
from tests.helpers.mcore_moe import (
    HIDDEN,
    copy_weights,
    megafab_layer,
    megafab_view,
    megatron_layer,
    megatron_losses,
    megatron_moe_on_cpu,
    set_megatron_loss_scale,
)

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
SINKHORN = dict(num_experts=4, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0)
CASES = {  # name -> (settings, model dtype)
    "top1": (dict(moe_router_topk=1), torch.float64),
    "top2": (dict(moe_router_topk=2), torch.float64),
    "top2_z_loss_jitter": (dict(moe_router_topk=2, num_experts=8, moe_z_loss_coeff=1e-3,
                                moe_input_jitter_eps=0.1), torch.float64),
    "top1_fp32_router": (dict(moe_router_topk=1, moe_router_dtype="fp32"), torch.float32),
    "top2_fp64_router": (dict(moe_router_topk=2, moe_router_dtype="fp64"), torch.float32),
}


@pytest.fixture(scope="module")
def megatron_cpu():
    with megatron_moe_on_cpu():
        yield


def _pair(settings, dtype):
    ref_layer, layer = megatron_layer(settings, True, dtype), megafab_layer(settings, True, dtype)
    copy_weights(ref_layer, layer, grouped=False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 2, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(32, 2, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    return ref_layer, layer, x, grad


def _error(a, b):
    return (a.double() - b.double()).abs().max().item()


def _routed(layer, x):
    torch.manual_seed(11)  # the input jitter's draws
    return layer.router(x)


def _step(layer, x, grad):
    x = x.clone().requires_grad_()
    torch.manual_seed(11)
    out = layer(x)[0]
    (out * grad).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("case", list(CASES))
def test_sinkhorn_training_equals_megatron(megatron_cpu, case, dispatcher):
    overrides, dtype = CASES[case]
    settings = MoESettings(**{**SINKHORN, **overrides, "moe_token_dispatcher_type": dispatcher})
    assert settings.problems() == []
    ref_layer, layer, x, grad = _pair(settings, dtype)
    tol = TOL[dtype]
    ref_probs, ref_map = _routed(ref_layer, x)
    probs, routing_map = _routed(layer, x)
    assert torch.equal(ref_map, routing_map) and probs.dtype == ref_probs.dtype
    assert _error(ref_probs, probs) <= tol
    with torch.no_grad():
        eval_map = _routed(layer.eval(), x)[1]
    layer.train()
    assert not torch.equal(eval_map, routing_map)  # the Sinkhorn choice is not plain top-k here
    set_megatron_loss_scale(0.5)
    layer.router.loss_scale.set(0.5)
    for what, a, b in zip(("output", "input grad"), _step(ref_layer, x, grad), _step(layer, x, grad)):
        assert _error(a, b) <= tol, what
    grads = {name: p.grad for name, p in layer.named_parameters()}
    for name, p in ref_layer.named_parameters():
        assert _error(p.grad, megafab_view(grads, name, False)) <= tol, name
    assert grads["router.weight"].abs().max() > 0
    ours = {name: value.item() for name, value in layer.router.logged_losses.items()}
    assert ours.keys() == megatron_losses().keys() == ({"z_loss"} if settings.moe_z_loss_coeff else set())


@pytest.mark.parametrize("topk", [1, 2])
def test_sinkhorn_eval_equals_megatron(megatron_cpu, topk):
    settings = MoESettings(**SINKHORN, moe_router_topk=topk)
    ref_layer, layer, x, _ = _pair(settings, torch.float64)
    ref_layer.eval(), layer.eval()
    with torch.no_grad():
        ref_probs, ref_map = ref_layer.router(x)
        probs, routing_map = layer.router(x)
        assert torch.equal(ref_map, routing_map) and _error(ref_probs, probs) <= 1e-12
        logits = x.reshape(-1, HIDDEN) @ layer.router.weight.t()  # sigmoid, softmax: monotone
        assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, logits.topk(topk)[1], True))
        assert _error(ref_layer(x)[0], layer(x)[0]) <= 1e-12


def test_sinkhorn_normalisation_is_megatron_bit_for_bit():
    """The float32 iteration itself, on logits wide enough to need many rounds."""
    from megatron.core.transformer.moe.moe_utils import sinkhorn as megatron_sinkhorn

    cost = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3
    ours = sinkhorn(cost)
    assert torch.equal(ours, megatron_sinkhorn(cost))
    # the doubly-stochastic scaling: each expert's column sums to ~1/E
    assert torch.allclose(ours.sum(dim=0), torch.full((8,), 1 / 8), atol=1e-3)
