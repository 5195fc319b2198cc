"""--microbatch-group-size-per-virtual-pipeline-stage (megatron-core's microbatch_group_size_per_vp_stage):
the interleaved schedule with 5 micro-batches in groups of 3 at PP 2 x VPP 2 -- a count Megatron's
default group of PP refuses -- trains as one process does (float64, 3 steps, parameters after each);
its rule (the group between PP and the micro-batches, the last group whole or at least PP) is one line."""

import pytest
import torch

from megafab.config.core import ConfigError
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
from tests.helpers.tiny import LLAMA_STYLE, tiny_config

GBS = MICRO * 5  # 5 micro-batches at DP 1


def _grouped(rank, world, group):
    flat = dict(pp=2, style=LLAMA_STYLE, vocab_size=112, micro_batch_size=MICRO, global_batch_size=GBS,
                num_layers_per_virtual_pipeline_stage=cfg_layers_per_chunk(2, 2), lr=1e-2, clip_grad=0.5,
                lr_decay_style="constant", train_iters=STEPS, microbatch_group_size_per_vp_stage=group)
    cfg = tiny_config(**flat)
    samples = make_samples(cfg.model, GBS * STEPS)
    reference = reference_run(tiny_config(style=LLAMA_STYLE, vocab_size=112, lr=1e-2, clip_grad=0.5),
                              samples, GBS)
    return train_and_compare(driver_state(cfg, torch.float64), samples, reference, GBS)


def test_five_micro_batches_in_groups_of_three_equal_single_process():
    run_ranks(_grouped, 2, 3, timeout=300)


@pytest.mark.parametrize("group,message", [
    (None, r"the interleaved schedule needs the number of micro-batches \(5 = global batch"),
    (6, "microbatch_group_size_per_vp_stage 6 must lie between pipeline-model-parallel-size 2 and "
        "num_microbatches 5"),
    (4, "leaves a last group of 1, fewer than pipeline-model-parallel-size 2"),
])
def test_the_group_rule(group, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(pp=2, style=LLAMA_STYLE, micro_batch_size=MICRO, global_batch_size=GBS,
                    num_layers_per_virtual_pipeline_stage=cfg_layers_per_chunk(2, 2),
                    microbatch_group_size_per_vp_stage=group)
