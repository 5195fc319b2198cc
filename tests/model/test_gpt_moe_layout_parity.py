"""A GPT with MoE layers under expert parallelism combined with PP, CP and TP x SP x PP equals one
process in float64 (within 1e-10), on real gloo ranks through megafab's own build and schedule
(build_model with DDP over DP x CP and expert-DP, run_schedule: the balancing losses' backward
weight, finalize_model_grads, the expert-bias update):

  - EP 2 x PP 2, EP 2 x CP 2, EP 2 x TP 2 (SP, ETP = TP) x PP 2: the logged lm loss and every
    parameter's gradient (TP / ETP shards joined; pipeline stages hold layers by their global
    index; local expert i of EP rank r is global expert r * experts_per_rank + i), plus the logged
    load_balancing_loss (its scores are float32 sums in megatron-core, so only 1e-6 there);
  - aux-loss-free balancing (--moe-router-enable-expert-bias) over 3 optimizer steps at EP 2 (DP 2),
    EP 2 on 4 ranks (DP 4, expert-DP 2) and EP 2 x TP 2 (SP, ETP 1): after each step every router's
    expert_bias, the lm loss and the grad norm, against one process that updates its biases from
    all the tokens; the bias moves (non-zero after the first step) and changes routing (the later
    losses differ from a run at rate 0).

The model: 4 layers, dense / MoE alternating ("[0,1]*2": each pipeline stage has both), top-2 of 4
experts, a shared expert, aux loss and z-loss on (their gradients are part of every comparison).
"""

from __future__ import annotations

import pytest
import torch

from megafab.config.moe import moe_settings
from megafab.model.moe.balancing import update_expert_biases
from megafab.model.moe.router import TopKRouter, routers_of
from megafab.optim.mixed_precision import MixedPrecisionOptimizer
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import train_step
from tests.helpers.driver import driver_state, make_samples, micro_batches
from tests.helpers.moe_parity import (
    configs,
    gradient_parity,
    merged_errors,
    reference_backward,
    reference_model,
)

TOL = 1e-10
STEPS = 3
MOE = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1, 0, 1), moe_aux_loss_coeff=1e-2,
           moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=40)
EXPERT_BIAS = dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                   moe_router_bias_update_rate=1e-2)


LAYOUTS = {  # name -> (world, layout)
    "ep2-pp2-alltoall-tied": (4, dict(pp=2, micro_batches_per_rank=4, moe_token_dispatcher_type="alltoall",
                                      untie_embeddings_and_output_weights=False)),
    "ep2-cp2-allgather": (4, dict(cp=2)),
    "ep2-tp2-sp-etp2-pp2-alltoall": (8, dict(tp=2, sp=True, pp=2, micro_batches_per_rank=4,
                                             moe_token_dispatcher_type="alltoall")),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_moe_layout_loss_and_gradients_equal_single_process(case):
    world, layout = LAYOUTS[case]
    results = run_ranks(gradient_parity, world, layout, MOE, timeout=240)
    errors = merged_errors(results)  # every parameter of the one-process model, held by some rank
    assert any(".local_experts.3." in n for n in errors) and any("router" in n for n in errors)
    assert any("shared_experts" in n for n in errors) and any(".mlp.linear_fc1" in n for n in errors)
    worst = max(errors, key=errors.get)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    balancing = [r["balancing"] for r in results if r["balancing"] is not None]
    print(f"{case}: max grad error {errors[worst]:.3g} ({worst}), max loss error {max(losses):.3g}, "
          f"load_balancing_loss rel. error {max(balancing):.3g}")
    assert errors[worst] < TOL, (worst, errors[worst])
    assert len(losses) == world // layout.get("pp", 1) and max(losses) < TOL, losses
    assert max(balancing) < 1e-6, balancing


def _router_biases(models) -> dict[str, torch.Tensor]:
    """{module name: expert_bias} of every router in these chunks (DDP-wrapped or not)."""
    return {name: m.expert_bias.clone() for model in models
            for name, m in getattr(model, "module", model).named_modules() if isinstance(m, TopKRouter)}


def _reference_steps(ref_cfg, samples):
    """STEPS one-process steps: (loss, grad norm, {router: expert_bias}) after each."""
    model = reference_model(ref_cfg)
    o, settings = ref_cfg.optimizer, moe_settings(ref_cfg)
    opt = MixedPrecisionOptimizer([model], lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad)
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = reference_backward(model, ref_cfg, samples, step)
        routers = routers_of([model])
        if settings.moe_router_enable_expert_bias:
            update_expert_biases(routers, settings.moe_router_bias_update_rate, None)
        for router in routers:
            router.reset_step_state()
        _, norm, _ = opt.step()
        history.append((loss, norm, _router_biases([model])))
    return history


def _expert_bias_parity(rank, world, layout):
    cfg, ref_cfg = configs(world, MOE, **layout, **EXPERT_BIAS)
    samples = make_samples(cfg.model, cfg.training.global_batch_size * STEPS)
    reference = _reference_steps(ref_cfg, samples)
    _, no_update_cfg = configs(world, MOE, **layout, **dict(EXPERT_BIAS, moe_router_bias_update_rate=0.0))
    no_update = _reference_steps(no_update_cfg, samples)

    state = driver_state(cfg, torch.float64)
    topo = state.topology
    assert (topo.ep, topo.tp) == (2, layout.get("tp", 1))
    errors = {"bias": 0.0, "loss": 0.0, "grad_norm": 0.0}
    for step in range(STEPS):
        data = micro_batches(samples, step * cfg.training.global_batch_size, topo.dp_rank, topo.dp,
                             cfg.training.num_micro_batches)
        metrics = train_step(state, data)
        ref_loss, ref_norm, ref_biases = reference[step]
        biases = _router_biases(state.model)
        assert sorted(biases) == sorted(ref_biases) and len(biases) == 2
        for name, bias in biases.items():
            # the first update moves every router's bias (a sign step can take it back to 0 later)
            assert step > 0 or bias.abs().max() > 0, (name, bias)
            err = (bias.double() - ref_biases[name].double()).abs().max().item()
            errors["bias"] = max(errors["bias"], err)
        errors["loss"] = max(errors["loss"], abs(metrics["lm loss"] - ref_loss))
        errors["grad_norm"] = max(errors["grad_norm"], abs(metrics["grad_norm"] - ref_norm))
    # the control: the bias changes routing, so the later steps' losses are not those of a run
    # whose biases stay at 0
    assert all(b.abs().max() == 0 for _, _, biases in no_update for b in biases.values())
    effect = max(abs(a[0] - b[0]) for a, b in zip(reference[1:], no_update[1:]))
    return errors, effect, [[b.tolist() for b in biases.values()] for _, _, biases in reference]


BIAS_LAYOUTS = {  # name -> (world, layout): the token counts summed over DP, over TP x DP
    "ep2-dp2-alltoall": (2, dict(moe_token_dispatcher_type="alltoall")),
    "ep2-dp4-edp2-alltoall": (4, dict(moe_token_dispatcher_type="alltoall")),
    "ep2-tp2-sp-etp1-allgather": (4, dict(tp=2, sp=True, expert_tensor_parallel_size=1)),
}


@pytest.mark.parametrize("case", list(BIAS_LAYOUTS))
def test_expert_bias_after_three_steps_equals_single_process(case):
    world, layout = BIAS_LAYOUTS[case]
    results = run_ranks(_expert_bias_parity, world, layout, timeout=240)
    worst = {k: max(r[0][k] for r in results) for k in results[0][0]}
    effect = results[0][1]
    print(f"{case}: max errors {worst}, loss change by the bias {effect:.3g}, "
          f"biases after each step {results[0][2]}")
    assert max(worst.values()) < TOL, worst
    assert effect > 1e-6, effect
