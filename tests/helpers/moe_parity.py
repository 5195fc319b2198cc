"""MoE layout parity on gloo ranks: a layout's config and the one-process config of the same model and
global batch, the one-process model and its backward, and one rank's gradient comparison through
megafab's own build and schedule (build_model with DDP over DP x CP and expert-DP, run_schedule,
finalize_model_grads). Local expert i of EP rank r is global expert r * experts_per_rank + i."""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch

from megafab.config.moe import moe_settings
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.moe.balancing import LossScale
from megafab.model.moe.loss_logging import moe_loss_values
from megafab.model.moe.router import routers_of
from megafab.model.transformer import LayerContext
from megafab.training.moe import logged_balancing_losses, num_moe_layers
from megafab.training.step import average_loss_across_dp, run_schedule
from tests.helpers.driver import MICRO, driver_state, make_samples, micro_batches
from tests.helpers.tiny import LLAMA_STYLE, full_grad, tiny_config

WORD = "embedding.word_embeddings.weight"
EXPERT_INDEX = re.compile(r"(\.local_experts\.)(\d+)(\.)")
SHARDING = ("tensor_model_parallel", "partition_dim", "partition_stride")  # what full_grad reads


def configs(world, moe: dict, tp=1, cp=1, pp=1, ep=2, sp=False, micro_batches_per_rank=2, steps=3,
            style=LLAMA_STYLE, **extra):
    """(this layout's config, the one-process config) of the same model (`moe`: its MoE fields) and
    global batch."""
    dp = world // (tp * cp * pp)
    gbs = MICRO * dp * micro_batches_per_rank
    common = dict(style=style, vocab_size=112, micro_batch_size=MICRO, global_batch_size=gbs,
                  lr=1e-2, lr_decay_style="constant", train_iters=steps, **moe, **extra)
    cfg = tiny_config(tp=tp, pp=pp, dp=dp * cp, context_parallel_size=cp, expert_model_parallel_size=ep,
                      sequence_parallel=sp, **common)
    assert cfg.parallel.data_parallel_size == dp and cfg.training.num_micro_batches == micro_batches_per_rank
    return cfg, tiny_config(**common)


def reference_model(ref_cfg):
    """The one-process model; the balancing losses' backward weight is 1 / micro-batches, as the
    schedule sets it for one rank."""
    ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), ref_cfg.training.seed,
                       moe=moe_settings(ref_cfg),
                       moe_loss_scale=LossScale(1.0 / ref_cfg.training.num_micro_batches))
    return GPTModel(ref_cfg.model, ctx)


def reference_backward(model, ref_cfg, samples, step):
    """Forward and backward of one global batch (the mean of its micro-batches' masked means)."""
    micro = list(micro_batches(samples, step * ref_cfg.training.global_batch_size, 0, 1,
                               ref_cfg.training.num_micro_batches))
    total = 0.0
    for mb in micro:
        loss = masked_mean_loss(model(mb["tokens"], labels=mb["labels"]), mb["loss_mask"]) / len(micro)
        loss.backward()
        total += loss.item()
    return total


def reference_name(name, cfg, topo):
    """The one-process name of a parameter of this rank's chunks."""
    if name == "output_layer.weight" and not cfg.model.untie_embeddings_and_output_weights:
        return WORD
    first = topo.coord("ep") * (cfg.moe.num_experts // topo.ep)
    return EXPERT_INDEX.sub(lambda m: f"{m[1]}{first + int(m[2])}{m[3]}", name)


def whole_grad(p, topo):
    """p.main_grad of the unsharded parameter: expert shards joined over ETP, the others over TP."""
    axis = "etp" if getattr(p, "is_expert", False) else "tp"
    shards = SimpleNamespace(grad=p.main_grad, **{a: getattr(p, a) for a in SHARDING if hasattr(p, a)})
    return full_grad(shards, topo.group(axis) if topo.size(axis) > 1 else None)


def gradient_parity(rank, world, layout, moe: dict):
    """One rank's errors against the one-process model: {"grad": {one-process name: max abs error},
    "loss": |lm loss error| (last stage, else None), "balancing": load_balancing_loss relative
    error (None where not logged), "ref_names": every one-process parameter name}."""
    cfg, ref_cfg = configs(world, moe, **layout)
    samples = make_samples(cfg.model, cfg.training.global_batch_size)
    reference = reference_model(ref_cfg)
    ref_loss = reference_backward(reference, ref_cfg, samples, 0)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    assert all(g.abs().max() > 0 for g in ref_grads.values())  # every expert got tokens
    settings = moe_settings(ref_cfg)
    ref_logged = moe_loss_values(settings, routers_of([reference]),
                                 num_moe_layers=num_moe_layers(settings, ref_cfg.model.num_layers),
                                 num_micro_batches=ref_cfg.training.num_micro_batches)

    state = driver_state(cfg, torch.float64)
    topo = state.topology
    assert (topo.ep, topo.tp, topo.cp, topo.pp) == (layout.get("ep", 2), layout.get("tp", 1),
                                                    layout.get("cp", 1), layout.get("pp", 1))
    state.optimizer.zero_grad()
    count = cfg.training.num_micro_batches
    logs = run_schedule(state, micro_batches(samples, 0, topo.dp_rank, topo.dp, count), forward_only=False)
    logged = logged_balancing_losses(state.model, moe_settings(cfg), cfg, topo, count)
    out = {"grad": {}, "loss": None, "balancing": None, "ref_names": sorted(ref_grads)}
    if topo.is_last_stage:
        out["loss"] = abs(average_loss_across_dp(logs, topo, topo.device) - ref_loss)
        name = "load_balancing_loss"
        if name in ref_logged:
            out["balancing"] = abs(logged[name] - ref_logged[name]) / ref_logged[name]
    for chunk in state.model:
        for name, p in chunk.module.named_parameters():
            ref_name = reference_name(name, cfg, topo)
            err = (whole_grad(p, topo) - ref_grads[ref_name]).abs().max().item()
            out["grad"][ref_name] = max(err, out["grad"].get(ref_name, 0.0))
    return out


def merged_errors(results) -> dict[str, float]:
    """{one-process name: the largest error any rank saw}; every parameter held by some rank."""
    errors: dict[str, float] = {}
    for r in results:
        for name, err in r["grad"].items():
            errors[name] = max(err, errors.get(name, 0.0))
    assert sorted(errors) == results[0]["ref_names"]
    return errors
