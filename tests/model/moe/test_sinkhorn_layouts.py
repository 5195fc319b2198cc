"""Sinkhorn routing under layouts that leave every router its tokens equals one process in float64
(within 1e-10), on real gloo ranks through megafab's build and schedule: EP 2 (DP 2, alltoall) and
EP 2 x PP 2 x DP 2, the lm loss and every parameter's gradient; EP 2 x PP 2 x DP 4 with the distributed
optimizer, 3 steps' lm loss and grad norm. The routing is checked to matter: the one-process loss with
plain top-k routing differs. Under SP or CP
each rank normalises its own tokens (megatron-core's behaviour), which the start-up note says."""

from __future__ import annotations

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.cli.pretrain import main
from megafab.optim.mixed_precision import MixedPrecisionOptimizer
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import train_step
from tests.helpers.driver import driver_state, make_samples, micro_batches
from tests.helpers.flags import tiny_flags
from tests.helpers.moe_parity import (
    configs,
    gradient_parity,
    merged_errors,
    reference_backward,
    reference_model,
)

TOL = 1e-10
STEPS = 3
MOE = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1, 0, 1), moe_aux_loss_coeff=0.0,
           moe_router_load_balancing_type="sinkhorn", moe_z_loss_coeff=1e-3)
LAYOUTS = {  # name -> (world, layout, top-k)
    "ep2-dp2-alltoall-top1": (2, dict(moe_token_dispatcher_type="alltoall"), 1),
    "ep2-pp2-dp2-top2": (4, dict(pp=2), 2),
}


def _parity_and_control(rank, world, layout, moe):
    """gradient_parity, and on rank 0 how much the one-process loss changes with plain top-k
    routing (top-1 softmax routing needs the softmax before the choice)."""
    out = gradient_parity(rank, world, layout, moe)
    if rank == 0:
        plain = {**moe, "moe_router_load_balancing_type": "none",
                 "moe_router_pre_softmax": moe["moe_router_topk"] == 1}
        losses = []
        for settings in (moe, plain):
            ref_cfg = configs(world, settings, **layout)[1]
            samples = make_samples(ref_cfg.model, ref_cfg.training.global_batch_size)
            losses.append(reference_backward(reference_model(ref_cfg), ref_cfg, samples, 0))
        out["routing_effect"] = abs(losses[0] - losses[1])
    return out


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_sinkhorn_layout_equals_single_process(case):
    world, layout, topk = LAYOUTS[case]
    moe = {**MOE, "moe_router_topk": topk}
    results = run_ranks(_parity_and_control, world, layout, moe, timeout=240)
    errors = merged_errors(results)
    worst = max(errors, key=errors.get)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    effect = results[0]["routing_effect"]
    print(f"{case}: max grad error {errors[worst]:.3g} ({worst}), max loss error {max(losses):.3g}, "
          f"loss change with plain top-k {effect:.3g}")
    assert any(".local_experts.3." in n for n in errors) and any("router" in n for n in errors)
    assert errors[worst] < TOL, (worst, errors[worst])
    assert len(losses) == world // layout.get("pp", 1) and max(losses) < TOL, losses
    assert effect > 1e-6, effect


def _distopt_steps(rank, world, layout, moe):
    """STEPS optimizer steps of this layout and of one process: the largest |lm loss| and |grad
    norm| differences (the distributed optimizer's shards hold no whole gradient to compare)."""
    cfg, ref_cfg = configs(world, moe, **layout)
    samples = make_samples(cfg.model, cfg.training.global_batch_size * STEPS)
    model, o = reference_model(ref_cfg), ref_cfg.optimizer
    opt = MixedPrecisionOptimizer([model], lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad)
    state = driver_state(cfg, torch.float64)
    topo, errors = state.topology, {"loss": 0.0, "grad_norm": 0.0}
    for step in range(STEPS):
        opt.zero_grad()
        ref_loss = reference_backward(model, ref_cfg, samples, step)
        ref_norm = opt.step()[1]
        data = micro_batches(samples, step * cfg.training.global_batch_size, topo.dp_rank, topo.dp,
                             cfg.training.num_micro_batches)
        metrics = train_step(state, data)
        if topo.is_last_stage:  # (the lm loss is the last stage's)
            errors["loss"] = max(errors["loss"], abs(metrics["lm loss"] - ref_loss))
        errors["grad_norm"] = max(errors["grad_norm"], abs(metrics["grad_norm"] - ref_norm))
    return errors


def test_sinkhorn_distributed_optimizer_steps_equal_single_process():
    layout = dict(pp=2, use_distributed_optimizer=True, moe_token_dispatcher_type="alltoall")
    results = run_ranks(_distopt_steps, 8, layout, MOE, timeout=240)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    print(f"ep2-pp2-dp4-distopt, {STEPS} steps: max errors {worst}")
    assert max(worst.values()) < TOL, worst


BASE = tiny_flags() + ["--micro-batch-size", "1", "--mock-data", "--vocab-size", "100", "--lr", "1e-4",
                       "--train-iters", "10", "--disable-bias-linear", "--num-experts", "4",
                       "--moe-router-load-balancing-type", "sinkhorn"]
NOTE = "--moe-router-load-balancing-type sinkhorn with {}: each rank's router normalises over its own 1/{}"


def test_sequence_parallel_note_is_printed(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # the job a --dry-run plans for
    assert main(BASE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"megafab: note: {NOTE.format('--sequence-parallel (TP 2)', 2)}" in out, out


@pytest.mark.parametrize("flags, world, note", [
    (["--context-parallel-size", "2"], 2, NOTE.format("--context-parallel-size 2", 2)),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"], 4,
     NOTE.format("--sequence-parallel (TP 2) and --context-parallel-size 2", 4)),
    (["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4, None),
])
def test_layout_note_only_where_the_router_sees_a_slice(flags, world, note):
    notes = [n for n in config_from_args(BASE + flags, world_size=world).start_up_notes() if "sinkhorn" in n]
    assert notes == ([] if note is None else [n for n in notes if n.startswith(note)]) and \
        len(notes) == (note is not None), notes
