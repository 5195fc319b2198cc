"""Expert tensor parallelism composed with attention TP + SP and EP equals the 1-rank MoE layer
(float64, gloo, within 1e-10): output, input gradient and every parameter gradient, for both
dispatchers, sequential and grouped experts, SwiGLU (strided fc1) and GELU with biases.

Groups from megafab's topology (Megatron's rank layout, no CP/PP): dense grid tp fastest, expert
grid etp fastest, then ep, then expert-DP. Every rank's [s/tp, b, h] tokens are distinct:
TP ranks hold sequence slices, DP ranks micro-batch columns. The 1-rank layer runs each DP
micro-batch (full sequence) and accumulates its gradients. Both layers come from the same seed (no
weight copying), so the sharded experts must hold exactly the 1-rank weights' partitions (checked
bit for bit). Gradients compared as the reductions after backward leave them: replicated and
sequence-parallel params summed over all ranks, TP-split shared experts gathered over TP and summed
over DP, expert params gathered over ETP and summed over expert-DP.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megafab.distributed.layers import join_partitions, partition_of
from megafab.distributed.mappings import group_rank, group_size
from megafab.distributed.topology import build_topology
from megafab.model.moe.settings import MoESettings
from megafab.run.fork_ranks import run_ranks
from tests.helpers.mcore_moe import HIDDEN, megafab_layer
from tests.helpers.tiny import full_grad

SEQ, BATCH = 8, 2
BASE = dict(num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
            moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True)
LAYOUTS = {  # name: (world, tp, ep, etp)
    "ep2_tp2_sp_etp1": (4, 2, 2, 1),
    "ep2_tp2_sp_etp2": (4, 2, 2, 2),
    "etp2": (2, 1, 1, 2),
    "tp2_sp_etp2": (2, 2, 1, 2),
}
VARIANTS = [(grouped, swiglu) for grouped in (False, True) for swiglu in (True, False)]  # GELU with biases


def _groups(tp, ep, etp):
    """The groups the training loop gives the layer (megafab.training.moe) and the reductions."""
    topo = build_topology(tp=tp, ep=ep, etp=etp)
    names = ("tp", "dp", "etp", "ep", "edp", "etp-ep", "tp-dp-cp")
    return topo, {name: topo.group(*name.split("-")) for name in names}


def _batch(dp: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, dp * BATCH, HIDDEN, generator=g, dtype=torch.float64)
    return x, torch.randn(SEQ, dp * BATCH, HIDDEN, generator=g, dtype=torch.float64)


def _forward_backward(layer, x, grad):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    (out * grad).sum().backward()
    return out.detach(), x.grad


def _reference_name(name: str, first: int, grouped: bool) -> tuple[str, slice | None]:
    """The 1-rank layer's parameter (and expert rows of a grouped one) of an expert parameter."""
    if grouped:
        return name, slice(first, None)
    parts = name.split(".")
    return ".".join([*parts[:2], str(first + int(parts[2])), *parts[3:]]), None


def _summed(tensor, group):
    tensor = tensor.clone()
    dist.all_reduce(tensor, group=group)
    return tensor


def _compare(topo, layout, dispatcher, grouped, swiglu, groups, case=None, idle=False):
    tp = layout[1]
    dp = topo.size("dp")
    settings = MoESettings(**{**BASE, **(case or {})}, moe_grouped_gemm=grouped,
                           moe_token_dispatcher_type=dispatcher)
    bias = idle or not swiglu  # idle: the router's bias keeps every token off the last EP rank's experts
    reference = megafab_layer(settings, swiglu, torch.float64, bias=bias)
    layer = megafab_layer(settings, swiglu, torch.float64, bias=bias, tp_group=groups["tp"],
                          sequence_parallel=tp > 1, ep_group=groups["ep"], etp_group=groups["etp"],
                          tp_ep_group=groups["etp-ep"],
                          tp_cp_group=groups["tp"], tp_dp_cp_group=groups["tp-dp-cp"])
    if bias:
        _give_biases(reference, layer, grouped, groups["etp"])
    if idle:
        with torch.no_grad():
            for router in (reference.router, layer.router):
                router.bias[settings.num_experts - layer.dispatcher.num_local_experts:] = -100.0
    x, grad = _batch(dp)
    tp_rank, dp_rank = topo.coord("tp"), topo.coord("dp")
    rows = slice(tp_rank * SEQ // tp, (tp_rank + 1) * SEQ // tp)
    cols = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
    for shard in range(dp):  # the 1-rank layer sees every micro-batch
        part = slice(shard * BATCH, (shard + 1) * BATCH)
        out, x_grad = _forward_backward(reference, x[:, part], grad[:, part])
        if shard == dp_rank:
            ref_out, ref_x_grad = out[rows], x_grad[rows]
    out, x_grad = _forward_backward(layer, x[rows, cols].contiguous(), grad[rows, cols].contiguous())
    errors = [(out - ref_out).abs().max().item(), (x_grad - ref_x_grad).abs().max().item()]

    init_error, first = 0.0, layer.dispatcher.first_expert
    ref_params = dict(reference.named_parameters())
    for name, p in layer.named_parameters():
        if getattr(p, "is_expert", False):
            ref_name, index = _reference_name(name, first, grouped)
            ref = ref_params[ref_name]
            ref_value, ref_grad = ref.detach(), ref.grad
            if index is not None:
                ref_value, ref_grad = ref_value[index][:p.shape[0]], ref_grad[index][:p.shape[0]]
            g = _summed(_joined(p.grad, p, groups["etp"]), groups["edp"])
            value = _joined(p.detach(), p, groups["etp"])
            init_error = max(init_error, (value - ref_value).abs().max().item())
        elif getattr(p, "tensor_model_parallel", False):
            g, ref_grad = _summed(full_grad(p, groups["tp"]), groups["dp"]), ref_params[name].grad
        else:
            g, ref_grad = _summed(p.grad, groups["tp-dp-cp"]), ref_params[name].grad
        errors.append((g - ref_grad).abs().max().item())
    expert_params = dict(layer.experts.named_parameters())
    split = {getattr(p, "tensor_model_parallel", False) for n, p in expert_params.items() if "weight" in n}
    marked = all(getattr(p, "is_expert", False) for p in expert_params.values()) and split == {
        group_size(groups["etp"]) > 1}  # split over ETP: the TP attributes at ETP > 1 only
    return max(errors), init_error, marked, sum(_count_rows(layer, x[rows, cols]))


@torch.no_grad()
def _give_biases(reference, layer, grouped, etp_group):
    """Values for the expert biases (megafab starts them at 0): random in the 1-rank layer, this
    rank's partition of them in the sharded one."""
    torch.manual_seed(0)
    ref_params, first = dict(reference.named_parameters()), layer.dispatcher.first_expert
    for name, p in ref_params.items():
        if name.startswith("experts.") and name.endswith("bias"):
            p.add_(torch.randn_like(p) * 0.05)
    rank, size = group_rank(etp_group), group_size(etp_group)
    for name, p in layer.experts.named_parameters(prefix="experts"):
        if name.endswith("bias"):
            ref_name, index = _reference_name(name, first, grouped)
            full = ref_params[ref_name] if index is None else ref_params[ref_name][index][:p.shape[0]]
            if getattr(p, "tensor_model_parallel", False):
                full = partition_of(full, p.partition_dim, rank, size, p.partition_stride)
            p.copy_(full)


def _joined(tensor, param, group):
    """A tensor of an ETP-split parameter (its value or gradient) joined over the ETP group."""
    if not getattr(param, "tensor_model_parallel", False) or group_size(group) == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(group_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return join_partitions(parts, param.partition_dim, param.partition_stride)


def _count_rows(layer, x):
    with torch.no_grad():
        probs, routing_map = layer.router(x)
        return layer.dispatcher.dispatch(x.reshape(-1, x.shape[-1]), probs, routing_map)[1]


def _rank(rank, world, layout, dispatcher, case=None, idle=False):
    topo, groups = _groups(*layout[1:])
    return [_compare(topo, layout, dispatcher, *variant, groups, case, idle) for variant in VARIANTS]


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_tensor_parallel_equals_one_rank(layout, dispatcher):
    layout = LAYOUTS[layout]
    for results in run_ranks(_rank, layout[0], layout, dispatcher, timeout=60):
        for error, init_error, marked, received in results:
            assert error <= 1e-10
            assert init_error == 0.0
            assert marked and received > 0


CAPACITY = {"capacity_drop": dict(moe_expert_capacity_factor=0.75),
            "capacity_pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)}


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("case", list(CAPACITY))
def test_expert_tensor_parallel_with_capacity(case, dispatcher):
    """Dropping (and padding) to capacity under ETP 2. TP 1: every rank routes one whole micro-batch,
    as the 1-rank layer does (under SP each rank would drop to the capacity of its s/tp tokens)."""
    layout = LAYOUTS["etp2"]
    for results in run_ranks(_rank, layout[0], layout, dispatcher, CAPACITY[case], timeout=60):
        for error, init_error, marked, received in results:
            assert error <= 1e-10 and init_error == 0.0 and marked and received > 0


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_expert_tensor_parallel_with_an_idle_expert_block(dispatcher):
    """EP 2 x ETP 2 (x TP 2 + SP): the last EP rank's experts get no token, so both of its ETP ranks
    gather, compute and reduce-scatter empty rows; everything still equals the 1-rank layer."""
    layout = LAYOUTS["ep2_tp2_sp_etp2"]
    results = run_ranks(_rank, layout[0], layout, dispatcher, idle=True, timeout=60)
    assert [{received > 0 for *_, received in rank} for rank in results] == [{True}, {True}, {False}, {False}]
    for rank in results:
        for error, init_error, marked, _ in rank:
            assert error <= 1e-10 and init_error == 0.0 and marked
