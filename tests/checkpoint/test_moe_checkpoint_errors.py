"""A checkpoint whose model does not match the flags -- MoE vs dense, another number of experts,
MoE layers elsewhere -- is refused in one CheckpointError naming what the checkpoint holds: from
its args (one line per differing MoE flag) and, for checkpoints without args, from its tensors."""

import argparse

import pytest
import torch

from megafab.checkpoint import CheckpointError, checkpointing
from megafab.checkpoint.megatron_args import model_arg_mismatches
from megafab.checkpoint.moe_check import check_moe_matches
from megafab.config.moe import MoEConfig
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import MOE, make_state, moe_state, train
from tests.helpers.tiny import LLAMA_STYLE, tiny_config


def _args(**values):
    m = tiny_config(style=LLAMA_STYLE).model
    return argparse.Namespace(num_layers=m.num_layers, hidden_size=m.hidden_size,
                              ffn_hidden_size=m.ffn_hidden_size, **values)


def test_moe_flags_are_compared_with_the_checkpoints_args():
    m = tiny_config(style=LLAMA_STYLE).model
    four = MoEConfig(num_experts=4, moe_router_topk=2)
    assert model_arg_mismatches(_args(num_experts=None), m, None) == []
    assert model_arg_mismatches(_args(num_experts=4, moe_router_topk=2), m, four) == []
    [line] = model_arg_mismatches(_args(num_experts=4, moe_router_topk=2), m, None)
    assert line == "--num-experts: checkpoint 4 (a mixture-of-experts model), this run None (a dense model)"
    [line] = model_arg_mismatches(_args(num_experts=None), m, four)
    assert line == "--num-experts: checkpoint None (a dense model), this run 4 (a mixture-of-experts model)"
    [line] = model_arg_mismatches(_args(num_experts=8, moe_router_topk=2), m, four)
    assert line.startswith("--num-experts: checkpoint 8")
    lines = model_arg_mismatches(_args(num_experts=4, moe_router_topk=1, moe_layer_freq=[0, 1, 1, 1],
                                       moe_ffn_hidden_size=None), m, four)
    assert lines == ["--moe-layer-freq: checkpoint [0, 1, 1, 1], this run 1",
                     "--moe-router-topk: checkpoint 1, this run 2"]  # moe_ffn None = ffn_hidden_size on both


def _md(*shape):
    return argparse.Namespace(size=torch.Size(shape))


def test_the_tensors_name_the_checkpoints_experts():
    moe = {"model.decoder.layers.1.mlp.experts.linear_fc1.weight": _md(4, 2, 8, 32),
           "model.decoder.layers.2.mlp.experts.linear_fc1.weight": _md(4, 2, 8, 32)}
    dense = {"model.decoder.layers.1.mlp.linear_fc1.weight": _md(2, 64, 32)}
    check_moe_matches(moe, {k: tuple(v.size) for k, v in moe.items()}, "ckpt")
    holds = r"^ckpt holds a mixture-of-experts model with 4 experts in layers 1, 2, but this run builds "
    with pytest.raises(CheckpointError, match=holds + r"a dense model \(no routed experts\)"):
        check_moe_matches(moe, {k: tuple(v.size) for k, v in dense.items()}, "ckpt")
    with pytest.raises(CheckpointError, match=r"^ckpt holds a dense model .* this run builds a mixture-of-"
                                              r"experts model with 8 experts in layers 1, 2"):
        check_moe_matches(dense, {k: (8, 2, 8, 32) for k in moe}, "ckpt")


def test_a_pipeline_stage_is_compared_on_its_own_layers():
    """A stage builds layers 2 and 3 of a 4-layer MoE checkpoint: it matches; other expert counts in
    its own layers do not."""
    key = "model.decoder.layers.{}.mlp.experts.linear_fc1.weight"
    stored = {key.format(i): _md(4, 2, 8, 32) for i in range(4)}
    check_moe_matches(stored, {key.format(i): (4, 2, 8, 32) for i in (2, 3)}, "ckpt")
    with pytest.raises(CheckpointError, match="holds a mixture-of-experts model with 4 experts in layers "
                                              "0, 1, 2, 3, but this run builds .* 8 experts in layers 2, 3"):
        check_moe_matches(stored, {key.format(i): (8, 2, 8, 32) for i in (2, 3)}, "ckpt")


def _save_moe(rank, world, path):
    state = moe_state(dp=1, dist_opt=False, save=path)
    train(state, 1)
    checkpointing.save_checkpoint(state)


def _load_into(rank, world, path, kind):
    state = make_state(tp=1, dp=1, dist_opt=False, style=LLAMA_STYLE, load=path) if kind == "dense" else \
        moe_state(dp=1, dist_opt=False, load=path, num_experts=8)
    try:
        checkpointing.load_checkpoint(state)
    except CheckpointError as e:
        return str(e)
    return None


def test_loading_a_moe_checkpoint_into_a_dense_or_other_moe_model_names_it(tmp_path):
    path = str(tmp_path / "moe")
    run_ranks(_save_moe, 1, path, timeout=120)
    dense = run_ranks(_load_into, 1, path, "dense", timeout=120)[0]
    assert dense is not None
    assert "--num-experts: checkpoint 4 (a mixture-of-experts model), this run None" in dense
    eight = run_ranks(_load_into, 1, path, "eight", timeout=120)[0]
    assert eight is not None and "--num-experts: checkpoint 4" in eight and "this run 8" in eight
    assert MOE["num_experts"] == 4
