"""Full 3D training through the driver's train_step equals one process, parameters after every step.

TP2 x PP2 x DP2 with sequence parallel and the distributed optimizer (and DP-only variants), float64,
3 AdamW steps with clipping, against a single-process model and MixedPrecisionOptimizer; and PP2 x DP2
under --use-tp-pp-dp-mapping's rank order (pipeline groups [0, 1], [2, 3]).
"""

import pytest
import torch

from megafab.run.fork_ranks import run_ranks
from tests.helpers.driver import (
    MICRO,
    STEPS,
    cfg_layers_per_chunk,
    driver_state,
    make_samples,
    reference_run,
    train_and_compare,
)
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, tiny_config


def _driver_parity(rank, world, tp, pp, vpp, sp, dist_opt, overlap, style, mapping=False):
    dp = world // (tp * pp)
    gbs = MICRO * dp * 2
    flat = dict(tp=tp, pp=pp, style=style, dp=dp, vocab_size=112, micro_batch_size=MICRO,
                use_tp_pp_dp_mapping=mapping,
                global_batch_size=gbs, sequence_parallel=sp, use_distributed_optimizer=dist_opt,
                overlap_grad_reduce=overlap, ddp_bucket_size=2000, lr=1e-2, clip_grad=0.5,
                lr_decay_style="constant", train_iters=STEPS)
    if vpp > 1:
        flat["num_layers_per_virtual_pipeline_stage"] = cfg_layers_per_chunk(pp, vpp)
    cfg = tiny_config(**flat)
    ref_cfg = tiny_config(style=style, vocab_size=112, lr=1e-2, clip_grad=0.5)
    samples = make_samples(cfg.model, gbs * STEPS)
    reference = reference_run(ref_cfg, samples, gbs)

    state = driver_state(cfg, torch.float64)
    if mapping:  # the pipeline's stages are neighbouring ranks, the replicas apart
        assert state.topology.group_ranks["pp"] == [rank - rank % pp + i for i in range(pp)]
    return train_and_compare(state, samples, reference, gbs)


@pytest.mark.parametrize("world,tp,pp,vpp,sp,dist_opt,overlap,style", [
    (2, 1, 1, 1, False, False, False, GPT2_STYLE),
    (2, 1, 1, 1, False, True, True, LLAMA_STYLE),
    (4, 1, 1, 1, False, True, False, GPT2_STYLE),
    (4, 1, 1, 1, False, False, True, GPT2_STYLE),
    (8, 2, 2, 1, True, True, False, GPT2_STYLE),
    (8, 2, 2, 2, True, True, True, LLAMA_STYLE),
], ids=["dp2", "dp2-distopt-overlap-llama", "dp4-distopt", "dp4-overlap", "tp2pp2dp2-sp-distopt",
        "tp2pp2vpp2dp2-sp-distopt-overlap-llama"])
def test_training_steps_equal_single_process(world, tp, pp, vpp, sp, dist_opt, overlap, style):
    run_ranks(_driver_parity, world, tp, pp, vpp, sp, dist_opt, overlap, style, timeout=300)


def test_tp_pp_dp_mapping_pp2_dp2_equals_single_process():
    run_ranks(_driver_parity, 4, 1, 2, 1, False, True, True, LLAMA_STYLE, True, timeout=300)


def _average_in_collective_parity(rank, world):
    gbs = MICRO * world * 2
    cfg = tiny_config(dp=world, vocab_size=112, micro_batch_size=MICRO, global_batch_size=gbs,
                      use_distributed_optimizer=True, ddp_average_in_collective=True, lr=1e-2,
                      clip_grad=0.5, lr_decay_style="constant", train_iters=STEPS)
    samples = make_samples(cfg.model, gbs * STEPS)
    reference = reference_run(tiny_config(vocab_size=112, lr=1e-2, clip_grad=0.5), samples, gbs)
    state = driver_state(cfg, torch.float64)
    assert all(chunk.average_in_collective for chunk in state.model)  # the flag reaches every DDP chunk
    return train_and_compare(state, samples, reference, gbs)


def test_ddp_average_in_collective_reaches_ddp_and_keeps_the_single_process_steps():
    """--ddp-average-in-collective: NCCL averages in the collective (tests/optim/gpu_check.py on a
    GPU); gloo has no AVG and keeps the scale-then-sum, so the steps equal one process's here."""
    run_ranks(_average_in_collective_parity, 2, timeout=300)
