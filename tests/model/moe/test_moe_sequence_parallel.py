"""The MoE layer under TP 2 + sequence parallel (expert TP 1, EP 1) equals the 1-rank layer
(float64, within 1e-10): each TP rank routes its own s/tp tokens through full experts, the
balancing losses count tokens over the TP group (Megatron's tp_cp group) and their logged values
are reduced over it, the shared experts are TP-sharded. Gradients compared as finalize_model_grads
leaves them: sequence-parallel replicated parameters (router, gate) and the experts (replicated
over TP, which is part of expert-DP here) summed over TP, TP-sharded shared-expert weights
gathered. The logged balancing losses are sums of float32 scores (megatron-core computes them so),
hence compared to float32 precision."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megafab.model.moe.loss_logging import moe_loss_values
from megafab.model.moe.settings import MoESettings
from megafab.run.fork_ranks import run_ranks
from tests.helpers.mcore_moe import HIDDEN, megafab_layer
from tests.helpers.tiny import full_grad

TP = 2
BASE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
            moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True)
CASES = {
    "aux_loss": dict(),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss"),
    "global_aux_loss": dict(moe_router_load_balancing_type="global_aux_loss"),
}
# Not here: capacity. Each rank drops to the capacity of its own s/tp tokens (as Megatron does), so
# the result is not the 1-rank layer's.


def _sp_rank(rank, world, settings):
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 2, HIDDEN, generator=g, dtype=torch.float64)
    grad = torch.randn(8, 2, HIDDEN, generator=g, dtype=torch.float64)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)

    reference = megafab_layer(settings, True, torch.float64)
    layer = megafab_layer(settings, True, torch.float64, tp_group=group, sequence_parallel=True,
                          tp_cp_group=group, tp_dp_cp_group=group)
    ref_x = x.clone().requires_grad_()
    ref_out, _ = reference(ref_x)
    (ref_out * grad).sum().backward()
    local_x = x[rows].clone().requires_grad_()
    out, _ = layer(local_x)
    (out * grad[rows]).sum().backward()

    errors = [(out - ref_out[rows]).abs().max().item(), (local_x.grad - ref_x.grad[rows]).abs().max().item()]
    ref_params = dict(reference.named_parameters())
    for name, p in layer.named_parameters():
        if getattr(p, "tensor_model_parallel", False) and not getattr(p, "is_expert", False):
            g_full = full_grad(p, group)  # expert params: split over ETP (1 here), not TP
        else:
            g_full = p.grad.clone()
            dist.all_reduce(g_full, group=group)  # partial over this rank's tokens
        errors.append((g_full - ref_params[name].grad).abs().max().item())
    z_losses = [torch.zeros((), dtype=torch.float64) for _ in range(world)]  # each rank: its tokens' mean
    dist.all_gather(z_losses, layer.router.logged_losses["z_loss"])
    one_rank = dict(num_moe_layers=1, num_micro_batches=1)
    ref = moe_loss_values(settings, [reference.router], **one_rank)
    ours = moe_loss_values(settings, [layer.router], tp_cp_group=group, tp_dp_cp_group=group, **one_rank)
    ours["z_loss"] = sum(z_losses).item() / world
    return max(errors), {name: abs(ours[name] - ref[name]) / ref[name] for name in ref}


@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_equals_one_rank(case):
    settings = MoESettings(**{**BASE, **CASES[case]})
    for error, logged in run_ranks(_sp_rank, TP, settings, timeout=60):
        assert error <= 1e-10
        assert logged.pop("z_loss") <= 1e-12
        (balancing,) = logged.values()
        assert balancing <= 2 * torch.finfo(torch.float32).eps
