"""gpt-oss's MoE under model parallelism equals one process in float64 (loss and every gradient within
1e-10, on gloo ranks through megafab's build and schedule: tests/helpers/moe_parity.py): clamped
quick-GEGLU with the +1 offset in a dense and an MoE layer (the clamp bites: a third of the gates,
two thirds of the linear halves at this init), biases on every linear, the router and every
expert's fc1 and fc2 (--add-bias-linear), aux and z losses, at EP 2 (alltoall), at TP 2 + SP with
expert TP 1 (as megatron-core, MoE biases need ETP 1: the rule is checked too) and at both."""

from __future__ import annotations

import pytest

from megafab.run.fork_ranks import run_ranks
from tests.helpers.moe_parity import gradient_parity, merged_errors
from tests.helpers.tiny import LLAMA_STYLE, tiny_config

TOL = 1e-10
GPT_OSS = dict(style=dict(LLAMA_STYLE, swiglu=False, add_bias_linear=True, group_query_attention=False),
               num_layers=2, quick_geglu=True, activation_func_clamp_value=0.05, glu_linear_offset=1.0,
               moe_token_dispatcher_type="alltoall")
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
DENSE_THEN_MOE = dict(moe_layer_freq=(0, 1))  # layer 0's dense MLP: the same activation, split over TP
LAYOUTS = {"ep2": (2, dict(ep=2)),
           "tp2-sp-etp1": (2, dict(tp=2, sp=True, ep=1, expert_tensor_parallel_size=1)),
           "ep2-tp2-sp-etp1": (4, dict(tp=2, sp=True, ep=2, expert_tensor_parallel_size=1))}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_gpt_oss_moe_equals_single_process(case):
    world, layout = LAYOUTS[case]
    results = run_ranks(gradient_parity, world, {**GPT_OSS, **layout}, {**MOE, **DENSE_THEN_MOE}, timeout=240)
    errors = merged_errors(results)
    for bias in ("1.mlp.router.bias", "1.mlp.experts.local_experts.0.linear_fc1.bias",
                 "1.mlp.experts.local_experts.3.linear_fc2.bias", "0.mlp.linear_fc1.bias"):
        assert f"decoder.layers.{bias}" in errors, bias
    worst = max(errors, key=errors.get)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    print(f"{case}: max grad error {errors[worst]:.3g} ({worst}), max loss error {max(losses):.3g}")
    assert errors[worst] < TOL, (worst, errors[worst])
    assert max(losses) < TOL, losses


def test_expert_biases_need_expert_tensor_parallel_size_one():
    """megatron-core asserts "Bias in Moe is only supported when ETP==1"; ETP defaults to TP."""
    tp2 = dict(tp=2, sequence_parallel=True, style=GPT_OSS["style"], **MOE)
    with pytest.raises(ValueError, match="biases in MoE experts need --expert-tensor-parallel-size 1"):
        tiny_config(**tp2)
    assert tiny_config(expert_tensor_parallel_size=1, **tp2).model.add_bias_linear
