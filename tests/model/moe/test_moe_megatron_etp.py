"""megafab's MoELayer equals megatron-core 0.16.1's with expert tensor parallelism 2 or EP 2, alone
or under attention TP 2 + SP, on 2 gloo ranks (each rank its own tokens: a micro-batch at TP 1, a
sequence slice under SP): every rank's output, input gradient and every parameter gradient
within 1e-12 in float64 (measured: bit-equal), for both dispatchers and megafab's sequential and
grouped experts (against megatron's SequentialMLP). The weights are megatron's shards copied into
megafab's, so this checks the layouts agree (SwiGLU fc1 [gate_r; up_r], fc2 row shards) and the
dispatch/combine collectives. No expert biases: megatron-core refuses them with ETP > 1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megafab.model.moe.settings import MoESettings

pytest.importorskip("megatron.core.transformer.moe.moe_layer")  # imported here, once: the ranks fork with it
from megafab.run.fork_ranks import run_ranks
from tests.helpers.mcore_moe import (
    HIDDEN,
    copy_weights,
    megafab_layer,
    megafab_view,
    megatron_layer,
    megatron_moe_on_cpu,
    set_megatron_loss_scale,
)

BASE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
LAYOUTS = {  # megatron-core's parallel sizes (ETP defaults to TP)
    "etp2": dict(expert_tensor_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
    "tp2_sp_etp2": dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=2),
    "tp2_sp_ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                       expert_tensor_parallel_size=1),
}


def _step(layer, x, grad):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    (out * grad).sum().backward()
    return out.detach(), x.grad


def _rank(rank, world, parallel, dispatcher, base=BASE):
    g = torch.Generator().manual_seed(3 + rank)  # each rank its own tokens
    x = torch.randn(8, 2, HIDDEN, generator=g, dtype=torch.float64)
    grad = torch.randn(8, 2, HIDDEN, generator=g, dtype=torch.float64)
    group = dist.new_group(list(range(world)))
    tp = group if parallel.get("tensor_model_parallel_size", 1) > 1 else None
    etp = group if parallel.get("expert_tensor_parallel_size", 1) > 1 else None
    ep = group if parallel.get("expert_model_parallel_size", 1) > 1 else None
    config = dict(parallel, sequence_parallel=tp is not None)
    errors = []
    with megatron_moe_on_cpu(**parallel):
        set_megatron_loss_scale(1.0)
        for grouped in (False, True):
            settings = MoESettings(**base, moe_grouped_gemm=grouped, moe_token_dispatcher_type=dispatcher)
            ref_layer = megatron_layer(settings, True, torch.float64, **config)
            layer = megafab_layer(settings, True, torch.float64, tp_group=tp, sequence_parallel=config[
                "sequence_parallel"], tp_cp_group=tp, ep_group=ep, etp_group=etp)
            copy_weights(ref_layer, layer, grouped)
            ref, ours = _step(ref_layer, x, grad), _step(layer, x, grad)
            errors += [(a - b).abs().max().item() for a, b in zip(ref, ours)]
            grads = {name: p.grad for name, p in layer.named_parameters()}
            for name, p in ref_layer.named_parameters():
                errors.append((p.grad - megafab_view(grads, name, grouped)).abs().max().item())
    return max(errors)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_layer_equals_megatron(layout, dispatcher):
    for error in run_ranks(_rank, 2, LAYOUTS[layout], dispatcher, timeout=90):
        assert error <= 1e-12


@pytest.mark.parametrize("layout", ["tp2_sp_etp2", "tp2_sp_ep2"])
def test_sinkhorn_under_sequence_parallelism_equals_megatron(layout):
    """--moe-router-load-balancing-type sinkhorn under SP: each rank's router normalises its own
    sequence slice, as megatron-core's does (no collective), and the layer agrees on every rank."""
    sinkhorn = dict(BASE, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0)
    for error in run_ranks(_rank, 2, LAYOUTS[layout], "alltoall", sinkhorn, timeout=90):
        assert error <= 1e-12
