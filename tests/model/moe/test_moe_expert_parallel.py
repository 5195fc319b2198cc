"""Expert parallelism on 2 gloo ranks equals the 1-rank MoE layer (float64, within 1e-10).

Tokens are split over the ranks as data parallelism splits them (rank r: micro-batch columns r),
the experts over the same 2 ranks (EP 2, expert-DP 1). Both layers are built from the same seed
(no weight copying): the EP rank must hold exactly its experts of the 1-rank layer. Gradients are
compared as DDP would leave them: replicated parameters (router, shared experts) averaged over the
ranks, expert parameters (summed over every rank's tokens by the dispatcher) divided by the DP size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megafab.model.moe.balancing import update_expert_biases
from megafab.model.moe.settings import MoESettings
from megafab.run.fork_ranks import run_ranks
from tests.helpers.mcore_moe import HIDDEN, megafab_layer

EP = 2
BASE = dict(num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
            moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True)
CASES = {
    "dropless": dict(),
    "four_experts": dict(num_experts=4),
    "capacity_drop": dict(moe_expert_capacity_factor=0.75),
    "capacity_pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    "grouped": dict(moe_grouped_gemm=True),
    "expert_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_bias_update_rate=0.05),
}


def _shard(rank, seq=8, batch=2, seed=3):
    """This rank's micro-batch of the global [seq, EP * batch, h] batch and its output gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, EP * batch, HIDDEN, generator=g, dtype=torch.float64)
    grad = torch.randn(seq, EP * batch, HIDDEN, generator=g, dtype=torch.float64)
    cols = slice(rank * batch, (rank + 1) * batch)
    return x[:, cols].contiguous(), grad[:, cols].contiguous()


def _forward_backward(layer, x, grad):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    (out * grad).sum().backward()
    return out.detach(), x.grad


def _local_expert_names(name: str, first: int, grouped: bool):
    """(the 1-rank layer's name, index into it) of an EP layer's expert parameter name."""
    if grouped:
        return name, slice(first, None)
    parts = name.split(".")
    return ".".join([*parts[:2], str(first + int(parts[2])), *parts[3:]]), None


def _ep_rank(rank, world, settings, steps, idle_last_rank=False):
    group = dist.new_group(list(range(world)))
    reference = megafab_layer(settings, True, torch.float64, bias=idle_last_rank)
    layer = megafab_layer(settings, True, torch.float64, bias=idle_last_rank, ep_group=group)
    first = layer.dispatcher.first_expert
    if idle_last_rank:  # the last rank's experts get no token: empty expert inputs everywhere
        with torch.no_grad():
            for router in (reference.router, layer.router):
                router.bias[settings.num_experts - layer.dispatcher.num_local_experts:] = -100.0
    received = 0
    errors = []
    for step in range(steps):
        for shard in range(world):  # the 1-rank layer sees every rank's micro-batch
            out, x_grad = _forward_backward(reference, *_shard(shard, seed=step))
            if shard == rank:
                ref_out, ref_x_grad = out, x_grad
        out, x_grad = _forward_backward(layer, *_shard(rank, seed=step))
        received += sum(_count_rows(layer, *_shard(rank, seed=step)))
        errors += [(out - ref_out).abs().max().item(), (x_grad - ref_x_grad).abs().max().item()]
        ref_params = dict(reference.named_parameters())
        for name, p in layer.named_parameters():
            grad = p.grad.clone()
            if getattr(p, "is_expert", False):
                ref_name, index = _local_expert_names(name, first, settings.moe_grouped_gemm)
                ref_grad = ref_params[ref_name].grad
                ref_grad = ref_grad if index is None else ref_grad[first:first + grad.shape[0]]
            else:
                dist.all_reduce(grad, group=group)
                ref_grad = ref_params[name].grad
            errors.append((grad / world - ref_grad / world).abs().max().item())
        if settings.moe_router_enable_expert_bias:
            update_expert_biases([reference.router], settings.moe_router_bias_update_rate, None)
            update_expert_biases([layer.router], settings.moe_router_bias_update_rate, group)
            errors.append((layer.router.expert_bias - reference.router.expert_bias).abs().max().item())
        for p in (*reference.parameters(), *layer.parameters()):
            p.grad = None
    return max(errors), received, layer.dispatcher.num_local_experts


def _count_rows(layer, x, _grad):
    """Rows this rank's experts receive for input x."""
    with torch.no_grad():
        probs, routing_map = layer.router(x)
        return layer.dispatcher.dispatch(x.reshape(-1, x.shape[-1]), probs, routing_map)[1]


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_equals_one_rank(case, dispatcher):
    settings = MoESettings(**{**BASE, **CASES[case], "moe_token_dispatcher_type": dispatcher})
    steps = 3 if settings.moe_router_enable_expert_bias else 1
    results = run_ranks(_ep_rank, EP, settings, steps, timeout=60)
    for error, received, local_experts in results:
        assert error <= 1e-10
        assert received > 0 and local_experts == settings.num_experts // EP


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_expert_parallel_with_an_idle_rank(dispatcher, grouped):
    """One EP rank's experts receive no token: their (zero) gradients and everything else still
    equal the 1-rank layer."""
    settings = MoESettings(**{**BASE, "moe_grouped_gemm": grouped, "moe_token_dispatcher_type": dispatcher})
    results = run_ranks(_ep_rank, EP, settings, 1, idle_last_rank=True, timeout=60)
    assert [received > 0 for _, received, _ in results] == [True, False]
    assert max(error for error, _, _ in results) <= 1e-10
