"""Sliding windows and learnable attention sinks through the driver's train_step equal one process
(float64, 3 AdamW steps with clipping, two micro-batches per step): FSDP2 at DP 2 (the sinks built
on the meta device and sharded like every parameter) and CP 2 with allgather and a2a (the window
from each rank's global positions, the sinks' gradient summed over CP with the others'); the grad
norm of every step and every parameter after it within 1e-10."""

import pytest
import torch

from megafab.run.fork_ranks import run_ranks
from tests.helpers.driver import MICRO, STEPS, driver_state, make_samples, reference_run, train_and_compare
from tests.helpers.tiny import LLAMA_STYLE, tiny_config

CLIP = 0.25
STYLE = dict(LLAMA_STYLE, num_query_groups=4, window_size=(4, 0), window_attn_skip_freq=2,
             softmax_type="learnable")


def _parity(rank, world, layout):
    cp = layout.get("context_parallel_size", 1)
    dp = world // cp
    gbs = MICRO * dp * 2
    cfg = tiny_config(style=STYLE, dp=world, vocab_size=112, micro_batch_size=MICRO, global_batch_size=gbs,
                      lr=1e-2, clip_grad=CLIP, lr_decay_style="constant", train_iters=STEPS, **layout)
    ref_cfg = tiny_config(style=STYLE, vocab_size=112, lr=1e-2, clip_grad=CLIP)
    samples = make_samples(cfg.model, gbs * STEPS)
    reference = reference_run(ref_cfg, samples, gbs)
    state = driver_state(cfg, torch.float64)
    return train_and_compare(state, samples, reference, gbs, min_norm=CLIP)


@pytest.mark.parametrize("layout", [dict(use_torch_fsdp2=True),
                                    dict(context_parallel_size=2, cp_comm_type="allgather"),
                                    dict(context_parallel_size=2, cp_comm_type="a2a")],
                         ids=["fsdp2-dp2", "cp2-allgather", "cp2-a2a"])
def test_driver_equals_single_process(layout):
    assert all(loss > 0 for loss in run_ranks(_parity, 2, layout, timeout=180))
