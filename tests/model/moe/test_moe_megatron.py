"""megafab's MoELayer equals megatron-core 0.16.1's MoELayer (local spec, SequentialMLP experts) for
the same weights: output, input gradient, every parameter gradient and the logged balancing / z
losses, within 1e-12 in float64 and 1e-5 in float32 (bf16, with and without the fp32 router: bit
for bit), for each routing feature and both dispatchers at EP 1. megafab's grouped experts are
checked against the same SequentialMLP (megatron-core's grouped experts need grouped_gemm or
Transformer Engine, neither of which runs on CPU)."""

from __future__ import annotations

import pytest
import torch

from megafab.model.moe.balancing import update_expert_biases
from megafab.model.moe.experts import grouped_mm_runs
from megafab.model.moe.loss_logging import moe_loss_values
from megafab.model.moe.routing import expert_capacity
from megafab.model.moe.settings import MoESettings
from tests.helpers.mcore_moe import (
    GPT_OSS_GLU,
    HIDDEN,
    copy_weights,
    megafab_layer,
    megafab_name,
    megafab_view,
    megatron_layer,
    megatron_losses,
    megatron_moe_on_cpu,
    set_megatron_loss_scale,
)

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 0.0}  # bf16: the same ops, bit-equal
BASE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)

CASES = {
    "softmax": dict(),
    "pre_softmax_scaling": dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5),
    "topk1_pre_softmax": dict(moe_router_topk=1, moe_router_pre_softmax=True),
    "sigmoid": dict(moe_router_score_function="sigmoid"),
    "group_limited": dict(num_experts=8, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2),
    "group_limited_sigmoid": dict(num_experts=8, moe_router_topk=2, moe_router_num_groups=4,
                                  moe_router_group_topk=1, moe_router_score_function="sigmoid"),
    "capacity_probs": dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="probs"),
    "capacity_position": dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="position"),
    "capacity_pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    "capacity_pad_position": dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True,
                                  moe_token_drop_policy="position"),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss"),
    "global_aux_loss": dict(moe_router_load_balancing_type="global_aux_loss"),
    "aux_and_seq_aux": dict(moe_router_load_balancing_type=("aux_loss", "seq_aux_loss"),
                            moe_aux_loss_coeff=(1e-2, 3e-3)),
    "no_balancing": dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0),
    "router_fp32": dict(moe_router_dtype="fp32"),
    "router_fp64": dict(moe_router_dtype="fp64"),
    "input_jitter": dict(moe_input_jitter_eps=0.1),
    "expert_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "shared_expert": dict(moe_shared_expert_intermediate_size=40),
    "shared_expert_gate": dict(moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True),
    "moe_ffn_hidden_size": dict(moe_ffn_hidden_size=24, num_experts=8),
}
# shared-expert overlap only exists for alltoall; it runs the same math
ALLTOALL_ONLY = {"shared_expert_overlap": dict(moe_shared_expert_intermediate_size=40,
                                               moe_shared_expert_gate=True, moe_shared_expert_overlap=True)}


@pytest.fixture(scope="module")
def megatron_cpu():
    with megatron_moe_on_cpu():
        yield


def _inputs(dtype, seq=8, batch=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, batch, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(seq, batch, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    return x, grad


def _step(layer, x, grad, scale, megatron: bool):
    """forward + backward of sum(out * grad) with the attached losses weighted by `scale`."""
    if megatron:
        set_megatron_loss_scale(scale)
    else:
        layer.router.loss_scale.set(scale)
    x = x.clone().requires_grad_()
    torch.manual_seed(11)  # the input jitter's draws
    out, bias = layer(x)
    assert bias is None
    (out * grad).sum().backward()
    return out.detach(), x.grad


def _max_error(a, b):
    return (a.double() - b.double()).abs().max().item()


def _compare(ref_layer, layer, grouped, dtype, ref, ours):
    tol = TOL[dtype]
    for what, a, b in zip(("output", "input grad"), ref, ours):
        assert _max_error(a, b) <= tol, what
    grads = {name: p.grad for name, p in layer.named_parameters()}
    assert all(g is not None for g in grads.values())
    for name, p in ref_layer.named_parameters():
        assert _max_error(p.grad, megafab_view(grads, name, grouped)) <= tol, name
    assert {megafab_name(name, grouped)[0] for name, _ in ref_layer.named_parameters()} == grads.keys()


def _check_losses(layer, dtype):
    ref = megatron_losses()
    ours = {name: value.item() for name, value in layer.router.logged_losses.items()}
    layer.router.logged_losses.clear()
    assert ref.keys() == ours.keys()
    for name in ref:
        assert abs(ref[name] - ours[name]) <= TOL[dtype] * max(1.0, abs(ref[name])), name
    return ours


def _run_case(settings, swiglu, dtype, grouped=False, bias=False, per_token=False, scale=0.5, glu=None):
    ref_layer = megatron_layer(settings, swiglu, dtype, bias, per_token, glu=glu)
    layer = megafab_layer(settings, swiglu, dtype, bias, per_token, glu=glu)
    copy_weights(ref_layer, layer, grouped)
    x, grad = _inputs(dtype)
    ref = _step(ref_layer, x, grad, scale, megatron=True)
    ours = _step(layer, x, grad, scale, megatron=False)
    _compare(ref_layer, layer, grouped, dtype, ref, ours)
    return _check_losses(layer, dtype)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_equals_megatron_float64(megatron_cpu, case, dispatcher):
    settings = MoESettings(**{**BASE, **CASES[case], "moe_token_dispatcher_type": dispatcher})
    losses = _run_case(settings, swiglu=True, dtype=torch.float64)
    if settings.moe_router_load_balancing_type != "none":
        assert losses and all(v > 0 for v in losses.values())


@pytest.mark.parametrize("case", list(ALLTOALL_ONLY))
def test_alltoall_only_equals_megatron(megatron_cpu, case):
    settings = MoESettings(**{**BASE, **ALLTOALL_ONLY[case], "moe_token_dispatcher_type": "alltoall"})
    _run_case(settings, swiglu=True, dtype=torch.float64)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("case", ["softmax", "sigmoid", "capacity_pad", "shared_expert_gate", "router_fp32",
                                  "router_fp64", "expert_bias"])
def test_layer_equals_megatron_float32(megatron_cpu, case, dispatcher):
    settings = MoESettings(**{**BASE, **CASES[case], "moe_token_dispatcher_type": dispatcher})
    _run_case(settings, swiglu=True, dtype=torch.float32)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("case", ["softmax", "router_fp32", "shared_expert_gate"])
def test_layer_equals_megatron_bf16(megatron_cpu, case, dispatcher):
    settings = MoESettings(**{**BASE, **CASES[case], "moe_token_dispatcher_type": dispatcher})
    _run_case(settings, swiglu=True, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gelu_experts_with_bias(megatron_cpu, dtype):
    _run_case(MoESettings(**BASE), swiglu=False, dtype=dtype, bias=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_gpt_oss_experts_equal_megatron(megatron_cpu, dispatcher, grouped, dtype):
    """gpt-oss's experts: clamped quick-GEGLU with the +1 offset, biases on the router and on every
    expert's fc1 and fc2 (megatron-core's unfused path: fc1's bias added before the clamp), the fp32
    router of its scripts (fc2's bias weighted in fp32, the output back in the model's dtype)."""
    settings = MoESettings(**{**BASE, "moe_grouped_gemm": grouped, "moe_token_dispatcher_type": dispatcher,
                              "moe_router_dtype": "fp32"})
    _run_case(settings, swiglu=False, dtype=dtype, grouped=grouped, bias=True, glu=GPT_OSS_GLU)
    layer = megafab_layer(settings, False, dtype, bias=True, glu=GPT_OSS_GLU)
    assert layer(_inputs(dtype)[0])[0].dtype == dtype  # not promoted by the fp32 probabilities


def test_per_token_loss_scaling(megatron_cpu):
    _run_case(MoESettings(**BASE), swiglu=True, dtype=torch.float64, per_token=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_grouped_experts_equal_megatron_sequential(megatron_cpu, dispatcher, dtype):
    settings = MoESettings(**{**BASE, "moe_grouped_gemm": True, "moe_token_dispatcher_type": dispatcher,
                              "moe_shared_expert_intermediate_size": 40})
    _run_case(settings, swiglu=True, dtype=dtype, grouped=True)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_expert_bias_updates_equal_megatron(megatron_cpu, dispatcher):
    """Three steps of aux-loss-free balancing: the bias after each step, and the routing it steers."""
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
        reset_model_temporary_tensors,
    )

    settings = MoESettings(**{**BASE, **CASES["expert_bias"], "moe_token_dispatcher_type": dispatcher,
                              "moe_router_bias_update_rate": 0.05})
    dtype = torch.float64
    ref_layer = megatron_layer(settings, True, dtype)
    layer = megafab_layer(settings, True, dtype)
    copy_weights(ref_layer, layer, grouped=False)
    for step in range(3):
        x, grad = _inputs(dtype, seed=step)
        ref = _step(ref_layer, x, grad, 1.0, megatron=True)
        ours = _step(layer, x, grad, 1.0, megatron=False)
        _compare(ref_layer, layer, False, dtype, ref, ours)
        assert torch.equal(ref_layer.router.local_tokens_per_expert, layer.router.local_tokens_per_expert)
        _update_router_expert_bias([ref_layer], ref_layer.config)
        reset_model_temporary_tensors(ref_layer.config, [ref_layer])
        update_expert_biases([layer.router], settings.moe_router_bias_update_rate, group=None)
        assert torch.equal(ref_layer.router.expert_bias, layer.router.expert_bias)
        assert layer.router.local_tokens_per_expert.sum() == 0
        for p in (*ref_layer.parameters(), *layer.parameters()):
            p.grad = None
    assert layer.router.expert_bias.abs().sum() > 0
    megatron_losses()


def test_global_aux_loss_averages_over_micro_batches(megatron_cpu):
    """global_aux_loss counts tokens over the micro-batches of a step until reset."""
    settings = MoESettings(**{**BASE, **CASES["global_aux_loss"]})
    ref_layer = megatron_layer(settings, True, torch.float64)
    layer = megafab_layer(settings, True, torch.float64)
    copy_weights(ref_layer, layer, grouped=False)
    for micro_batch in range(2):
        x, grad = _inputs(torch.float64, seed=micro_batch)
        ref = _step(ref_layer, x, grad, 0.5, megatron=True)
        ours = _step(layer, x, grad, 0.5, megatron=False)
        _compare(ref_layer, layer, False, torch.float64, ref, ours)
    assert layer.router.global_steps.item() == 2
    _check_losses(layer, torch.float64)
    layer.router.reset_step_state()
    assert layer.router.global_steps.item() == 0


def test_eval_attaches_no_losses(megatron_cpu):
    settings = MoESettings(**BASE)
    ref_layer, layer = megatron_layer(settings, True, torch.float64).eval(), \
        megafab_layer(settings, True, torch.float64).eval()
    copy_weights(ref_layer, layer, grouped=False)
    x, _ = _inputs(torch.float64)
    with torch.no_grad():
        assert _max_error(ref_layer(x)[0], layer(x)[0]) <= 1e-12
    assert not layer.router.logged_losses and not megatron_losses()


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("capacity")])
def test_capacity_cases_drop_or_pad(case):
    """The capacity cases above are not vacuous: tokens are dropped, or every expert is padded to
    exactly its capacity; the position policy keeps each expert's first tokens."""
    settings = MoESettings(**{**BASE, **CASES[case]})
    layer = megafab_layer(settings, True, torch.float64)
    x, _ = _inputs(torch.float64)
    probs, routing_map = layer.router(x)
    tokens = x.shape[0] * x.shape[1]
    capacity = expert_capacity(tokens * settings.moe_router_topk, settings.num_experts,
                               settings.moe_expert_capacity_factor)
    per_expert = routing_map.sum(dim=0)
    if settings.moe_pad_expert_input_to_capacity:
        assert (per_expert == capacity).all()
    else:
        assert per_expert.max() <= capacity and per_expert.sum() < tokens * settings.moe_router_topk
    if settings.moe_token_drop_policy == "position":
        first = torch.cumsum(routing_map.int(), dim=0)
        assert (first[routing_map] <= capacity).all()
    assert ((probs != 0) <= routing_map).all()


def test_grouped_experts_use_torch_grouped_mm_where_it_runs():
    """float32 on CPU takes torch's grouped matmul (the float32 grouped test above exercises it);
    float64 has no such kernel and takes the per-expert loop."""
    settings = MoESettings(**{**BASE, "moe_grouped_gemm": True})
    for dtype, expected in ((torch.float32, True), (torch.float64, False)):
        experts = megafab_layer(settings, True, dtype).experts
        rows = torch.zeros(5, HIDDEN, dtype=dtype)
        assert grouped_mm_runs(rows, experts.linear_fc1.weight) is expected
        assert grouped_mm_runs(rows, experts.linear_fc2.weight) is expected


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_logged_losses_equal_megatron_track_moe_metrics(megatron_cpu, balancing):
    """The iteration log's values over 2 MoE layers and 2 micro-batches equal megatron-core's
    track_moe_metrics (its tracker holds float32, hence the tolerance)."""
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    settings = MoESettings(**{**BASE, "moe_router_load_balancing_type": balancing})
    pairs = []
    for number in (1, 2):
        ref_layer = megatron_layer(settings, True, torch.float64, layer_number=number, fresh_logs=number == 1)
        layer = megafab_layer(settings, True, torch.float64, seed=number)
        copy_weights(ref_layer, layer, grouped=False)
        pairs.append((ref_layer, layer))
    for micro_batch in range(2):
        for ref_layer, layer in pairs:
            x, grad = _inputs(torch.float64, seed=micro_batch)
            _step(ref_layer, x, grad, 0.5, megatron=True)
            _step(layer, x, grad, 0.5, megatron=False)
    reference = {}
    track_moe_metrics(loss_scale=1 / 2, iteration=1, total_loss_dict=reference, num_layers=2,
                      moe_layer_freq=1)
    routers = [layer.router for _, layer in pairs]
    ours = moe_loss_values(settings, routers, num_moe_layers=2, num_micro_batches=2)
    assert set(ours) <= set(reference) and len(ours) == 2
    for name, value in ours.items():
        assert abs(value - reference[name].item()) <= 1e-6 * abs(value), name
    assert not pairs[0][1].router.logged_losses
    megatron_losses()


def test_expert_bias_stays_float32_when_the_model_is_cast():
    """As megatron-core keeps it: a bf16 (or float64) model still routes with a float32 bias."""
    layer = megafab_layer(MoESettings(**{**BASE, **CASES["expert_bias"]}), True, torch.float32)
    layer.to(torch.bfloat16)
    assert layer.router.weight.dtype == torch.bfloat16
    assert layer.router.expert_bias.dtype == torch.float32 == layer.router.local_tokens_per_expert.dtype
    state = layer.state_dict()
    assert "router.expert_bias" in state and "router.local_tokens_per_expert" not in state
