"""ZeRO-3 (torch FSDP2) and optimizer CPU offload through the driver's train_step equal one process.

float64, 3 AdamW steps with clipping (clip 0.25 binds in every step), two micro-batches per step
(gradient accumulation under FSDP2's no_sync), against the single-process model and
MixedPrecisionOptimizer: the grad norm of every step and every parameter after it within 1e-10.
FSDP2 at DP 2 and 4, FSDP2 x TP 2 + SP, FSDP2 x PP 2, FSDP2 DP 2 x CP 2 (sharded over DP x CP),
each with and without offload (a fraction that splits the entries between host and device where it
is not 1), FSDP2 with full recompute (two layers per recompute group, i.e. two FSDP2 units) and
without resharding after forward, and offload with the distributed optimizer and with plain DDP;
bf16/fp16 against DDP's losses; SGD with momentum against DDP.
"""

import pytest
import torch

from megafab.distributed.fsdp import local_tensor
from megafab.optim.fully_sharded_optimizer import FullyShardedOptimizer
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import train_step
from tests.helpers.driver import (
    MICRO,
    STEPS,
    driver_state,
    full_values,
    make_samples,
    reference_run,
    train_and_compare,
)
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, batch, tiny_config

CLIP = 0.25


def _parity(rank, world, tp, pp, sp, style, layout):
    cp = layout.get("context_parallel_size", 1)
    dp = world // (tp * pp * cp)
    gbs = MICRO * dp * 2
    flat = dict(tp=tp, pp=pp, style=style, dp=dp * cp, vocab_size=112, micro_batch_size=MICRO,
                global_batch_size=gbs, sequence_parallel=sp, lr=1e-2, clip_grad=CLIP,
                lr_decay_style="constant", train_iters=STEPS, **layout)
    cfg = tiny_config(**flat)
    ref_cfg = tiny_config(style=style, vocab_size=112, lr=1e-2, clip_grad=CLIP)
    samples = make_samples(cfg.model, gbs * STEPS)
    reference = reference_run(ref_cfg, samples, gbs)

    state = driver_state(cfg, torch.float64)
    optimizer = state.optimizer
    assert isinstance(optimizer, FullyShardedOptimizer) == cfg.parallel.fully_sharded
    host = optimizer.host.entries if optimizer.host is not None else []
    if cfg.optimizer.optimizer_cpu_offload:
        assert host and all(e.main.device.type == "cpu" and e.is_copy for e in host)
        assert (len(host) < len(optimizer.entries)) == (cfg.optimizer.optimizer_offload_fraction < 1)
    if cfg.parallel.fully_sharded:
        # Each rank holds only its rows: the local shards of a big weight are a 1/(DP x CP) share of it.
        big = max(optimizer.entries, key=lambda e: e.model_param.numel())
        assert local_tensor(big.model_param).numel() <= -(-big.model_param.shape[0] // (dp * cp)) * \
            (big.model_param.numel() // big.model_param.shape[0])
    return train_and_compare(state, samples, reference, gbs, min_norm=CLIP)


FSDP = dict(use_torch_fsdp2=True)
OFFLOAD = dict(optimizer_cpu_offload=True)
CP2 = dict(context_parallel_size=2)  # FSDP2 shards over DP x CP, Megatron's dp-cp group
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)


def fraction(f):
    return dict(optimizer_offload_fraction=f)


CASES = {
    "fsdp-dp2": (2, 1, 1, False, GPT2_STYLE, FSDP),
    "fsdp-dp2-offload-0.6": (2, 1, 1, False, GPT2_STYLE, {**FSDP, **OFFLOAD, **fraction(0.6)}),
    "fsdp-dp4-llama": (4, 1, 1, False, LLAMA_STYLE, FSDP),
    "fsdp-dp2-recompute-zero2": (2, 1, 1, False, LLAMA_STYLE, {**FSDP, **RECOMPUTE,
                                                               "torch_fsdp2_reshard_after_forward": False}),
    "fsdp-dp4-offload": (4, 1, 1, False, GPT2_STYLE, {**FSDP, **OFFLOAD}),
    "fsdp-tp2-sp-dp2": (4, 2, 1, True, GPT2_STYLE, FSDP),
    "fsdp-tp2-sp-dp2-offload-llama": (4, 2, 1, True, LLAMA_STYLE, {**FSDP, **OFFLOAD}),
    "fsdp-pp2-dp2": (4, 1, 2, False, GPT2_STYLE, FSDP),
    "fsdp-pp2-dp2-offload-0.5": (4, 1, 2, False, GPT2_STYLE, {**FSDP, **OFFLOAD, **fraction(0.5)}),
    "fsdp-dp2-cp2-p2p-llama": (4, 1, 1, False, LLAMA_STYLE, {**FSDP, **CP2}),
    "fsdp-dp2-cp2-a2a-offload": (4, 1, 1, False, GPT2_STYLE, {**FSDP, **OFFLOAD, **CP2,
                                                               "cp_comm_type": "a2a"}),
    "distopt-dp2-offload": (2, 1, 1, False, LLAMA_STYLE, {"use_distributed_optimizer": True, **OFFLOAD}),
    "ddp-dp2-offload-0.5": (2, 1, 1, False, GPT2_STYLE, {**OFFLOAD, **fraction(0.5)}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_steps_equal_single_process(case):
    world, tp, pp, sp, style, layout = CASES[case]
    run_ranks(_parity, world, tp, pp, sp, style, layout, timeout=300)


def _mixed_precision_losses(rank, world, precision, layout):
    scaler = dict(initial_loss_scale=2.0**12)  # fp16 steps from the first one
    cfg = tiny_config(dp=world, global_batch_size=2 * world, lr=1e-2, **{precision: True}, **scaler, **layout)
    state = driver_state(cfg)
    topo, optimizer = state.topology, state.optimizer
    out = []
    for step in range(3):
        tokens, labels, mask = batch(cfg.model, seed=10 * step + topo.dp_rank)
        metrics = train_step(state, iter([{"tokens": tokens, "labels": labels, "loss_mask": mask}]))
        scale = optimizer.grad_scaler.scale if optimizer.grad_scaler is not None else None
        out.append((metrics["lm loss"], metrics["update_ok"], scale))
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_like_ddp(precision):
    """bf16/fp16 compute, fp32 reduction and masters: FSDP2 (fp32 shards), FSDP2 with offload
    (16-bit shards, host masters) and dist-opt with offload log DDP's losses (up to the reduction
    order), and the fp16 loss scaler takes the same steps with the same scale."""
    ddp = run_ranks(_mixed_precision_losses, 2, precision, {}, timeout=300)[0]
    for layout in (FSDP, {**FSDP, **OFFLOAD}, {"use_distributed_optimizer": True, **OFFLOAD}):
        got = run_ranks(_mixed_precision_losses, 2, precision, layout, timeout=300)[0]
        for (loss, ok, scale), (ref_loss, ref_ok, ref_scale) in zip(got, ddp):
            assert (ok, scale) == (ref_ok, ref_scale), (layout, got, ddp)
            assert abs(loss - ref_loss) <= 2e-3 * abs(ref_loss), (layout, got, ddp)
    assert all(ok for _, ok, _ in ddp) and ddp[-1][0] < ddp[0][0]


def _sgd_params(rank, world, layout):
    cfg = tiny_config(dp=world, global_batch_size=2 * world, lr=1e-2, optimizer="sgd", train_iters=5,
                      **layout)
    state = driver_state(cfg, torch.float64)
    for step in range(3):
        tokens, labels, mask = batch(cfg.model, seed=10 * step + state.topology.dp_rank)
        train_step(state, iter([{"tokens": tokens, "labels": labels, "loss_mask": mask}]))
    return {n: full_values(p, None) for n, p in state.model[0].module.named_parameters()}


def test_sgd_with_momentum_under_fsdp2_and_offload_equals_ddp():
    ddp = run_ranks(_sgd_params, 2, {}, timeout=300)[0]
    for layout in (FSDP, {**FSDP, **OFFLOAD, **fraction(0.5)}, OFFLOAD):
        got = run_ranks(_sgd_params, 2, layout, timeout=300)[0]
        for name, want in ddp.items():
            assert (got[name] - want).abs().max().item() < 1e-12, (layout, name)
