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

import re
from types import SimpleNamespace

import pytest
import torch

from megafab.config.moe import moe_settings
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.moe.balancing import LossScale, update_expert_biases
from megafab.model.moe.loss_logging import moe_loss_values
from megafab.model.moe.router import TopKRouter, routers_of
from megafab.model.transformer import LayerContext
from megafab.optim.mixed_precision import MixedPrecisionOptimizer
from megafab.run.fork_ranks import run_ranks
from megafab.training.moe import logged_balancing_losses, num_moe_layers
from megafab.training.step import average_loss_across_dp, run_schedule, train_step
from tests.helpers.driver import MICRO, driver_state, make_samples, micro_batches
from tests.helpers.tiny import LLAMA_STYLE, full_grad, tiny_config

TOL = 1e-10
WORD = "embedding.word_embeddings.weight"
STEPS = 3
MOE = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1, 0, 1), moe_aux_loss_coeff=1e-2,
           moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=40)
EXPERT_BIAS = dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                   moe_router_bias_update_rate=1e-2)
EXPERT_INDEX = re.compile(r"(\.local_experts\.)(\d+)(\.)")
SHARDING = ("tensor_model_parallel", "partition_dim", "partition_stride")  # what full_grad reads


def _configs(world, tp=1, cp=1, pp=1, ep=2, sp=False, micro_batches_per_rank=2, **extra):
    """(this layout's config, the one-process config) of the same model and global batch."""
    dp = world // (tp * cp * pp)
    gbs = MICRO * dp * micro_batches_per_rank
    common = dict(style=LLAMA_STYLE, vocab_size=112, micro_batch_size=MICRO, global_batch_size=gbs,
                  lr=1e-2, lr_decay_style="constant", train_iters=STEPS, **MOE, **extra)
    cfg = tiny_config(tp=tp, pp=pp, dp=dp * cp, context_parallel_size=cp, expert_model_parallel_size=ep,
                      sequence_parallel=sp, **common)
    assert cfg.parallel.data_parallel_size == dp and cfg.training.num_micro_batches == micro_batches_per_rank
    return cfg, tiny_config(**common)


def _reference_model(ref_cfg):
    """The one-process model; the balancing losses' backward weight is 1 / micro-batches, as the
    schedule sets it for one rank."""
    ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), ref_cfg.training.seed,
                       moe=moe_settings(ref_cfg),
                       moe_loss_scale=LossScale(1.0 / ref_cfg.training.num_micro_batches))
    return GPTModel(ref_cfg.model, ctx)


def _reference_backward(model, ref_cfg, samples, step):
    """Forward and backward of one global batch (the mean of its micro-batches' masked means)."""
    micro = list(micro_batches(samples, step * ref_cfg.training.global_batch_size, 0, 1,
                               ref_cfg.training.num_micro_batches))
    total = 0.0
    for mb in micro:
        loss = masked_mean_loss(model(mb["tokens"], labels=mb["labels"]), mb["loss_mask"]) / len(micro)
        loss.backward()
        total += loss.item()
    return total


def _reference_name(name, cfg, topo):
    """The one-process name of a parameter of this rank's chunks."""
    if name == "output_layer.weight" and not cfg.model.untie_embeddings_and_output_weights:
        return WORD
    first = topo.coord("ep") * (cfg.moe.num_experts // topo.ep)
    return EXPERT_INDEX.sub(lambda m: f"{m[1]}{first + int(m[2])}{m[3]}", name)


def _whole_grad(p, topo):
    """p.main_grad of the unsharded parameter: expert shards joined over ETP, the others over TP."""
    axis = "etp" if getattr(p, "is_expert", False) else "tp"
    shards = SimpleNamespace(grad=p.main_grad, **{a: getattr(p, a) for a in SHARDING if hasattr(p, a)})
    return full_grad(shards, topo.group(axis) if topo.size(axis) > 1 else None)


def _gradient_parity(rank, world, layout):
    cfg, ref_cfg = _configs(world, **layout)
    samples = make_samples(cfg.model, cfg.training.global_batch_size)
    reference = _reference_model(ref_cfg)
    ref_loss = _reference_backward(reference, ref_cfg, samples, 0)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    assert all(g.abs().max() > 0 for g in ref_grads.values())  # every expert got tokens
    settings = moe_settings(ref_cfg)
    ref_logged = moe_loss_values(settings, routers_of([reference]),
                                 num_moe_layers=num_moe_layers(settings, ref_cfg.model.num_layers),
                                 num_micro_batches=ref_cfg.training.num_micro_batches)

    state = driver_state(cfg, torch.float64)
    topo = state.topology
    assert (topo.ep, topo.tp, topo.cp, topo.pp) == (2, layout.get("tp", 1), layout.get("cp", 1),
                                                    layout.get("pp", 1))
    state.optimizer.zero_grad()
    count = cfg.training.num_micro_batches
    logs = run_schedule(state, micro_batches(samples, 0, topo.dp_rank, topo.dp, count), forward_only=False)
    logged = logged_balancing_losses(state.model, moe_settings(cfg), cfg, topo, count)
    out = {"grad": {}, "loss": None, "balancing": None, "ref_names": sorted(ref_grads)}
    if topo.is_last_stage:
        out["loss"] = abs(average_loss_across_dp(logs, topo, topo.device) - ref_loss)
        name = "load_balancing_loss"
        out["balancing"] = abs(logged[name] - ref_logged[name]) / ref_logged[name]
    for chunk in state.model:
        for name, p in chunk.module.named_parameters():
            ref_name = _reference_name(name, cfg, topo)
            err = (_whole_grad(p, topo) - ref_grads[ref_name]).abs().max().item()
            out["grad"][ref_name] = max(err, out["grad"].get(ref_name, 0.0))
    return out


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
    results = run_ranks(_gradient_parity, world, layout, timeout=240)
    errors: dict[str, float] = {}
    for r in results:
        for name, err in r["grad"].items():
            errors[name] = max(err, errors.get(name, 0.0))
    # every parameter of the one-process model is held (and compared) by some rank
    assert sorted(errors) == results[0]["ref_names"]
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
    model = _reference_model(ref_cfg)
    o, settings = ref_cfg.optimizer, moe_settings(ref_cfg)
    opt = MixedPrecisionOptimizer([model], lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad)
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = _reference_backward(model, ref_cfg, samples, step)
        routers = routers_of([model])
        if settings.moe_router_enable_expert_bias:
            update_expert_biases(routers, settings.moe_router_bias_update_rate, None)
        for router in routers:
            router.reset_step_state()
        _, norm, _ = opt.step()
        history.append((loss, norm, _router_biases([model])))
    return history


def _expert_bias_parity(rank, world, layout):
    cfg, ref_cfg = _configs(world, **layout, **EXPERT_BIAS)
    samples = make_samples(cfg.model, cfg.training.global_batch_size * STEPS)
    reference = _reference_steps(ref_cfg, samples)
    _, no_update_cfg = _configs(world, **layout, **dict(EXPERT_BIAS, moe_router_bias_update_rate=0.0))
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
