"""The estimator counts learnable attention sinks as the engine builds them (read off the meta-device
build): each stage's planned parameters at TP 1/2 x PP 1/2 equal the built chunks', heads/TP more per
layer than without sinks, the model total and the checkpoint keys include every layer's
softmax_offset; FLOPs count windowed layers as full attention, as Megatron-LM HEAD's
num_floating_point_operations does (and sinks add none)."""

import dataclasses

import pytest
import torch

from megafab.convert.state_dict import expected_keys
from megafab.distributed.sized_group import SizedGroup
from megafab.model.gpt import GPTModel, build_model_chunks
from megafab.model.transformer import LayerContext
from megafab.pipeline_split import PipelineSplit
from megafab.plan.flops import flops_per_iteration
from megafab.plan.params import model_params
from megafab.plan.planner import plan
from tests.helpers.tiny import LLAMA_STYLE, tiny_config

STYLE = dict(LLAMA_STYLE, window_size=(3, 0), window_attn_skip_freq=2, softmax_type="learnable")


def _config(tp=1, pp=1, **overrides):
    return tiny_config(tp=tp, pp=pp, style=STYLE, sequence_parallel=tp > 1, global_batch_size=2 * pp,
                       **overrides)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_planned_parameters_equal_the_built_chunks_with_sinks(tp, pp):
    cfg = _config(tp, pp)
    split = PipelineSplit.from_config(cfg)
    plain = plan(dataclasses.replace(cfg, model=cfg.model.replaced(softmax_type="vanilla")))
    for stage, without in zip(plan(cfg), plain):
        ctx = LayerContext(SizedGroup(tp, tp - 1), tp > 1, torch.float32, torch.device("cpu"), 1)
        chunks = build_model_chunks(cfg.model, ctx, split.pp, stage.pp_rank, split.vpp, split, on_meta=True)
        assert stage.params == sum(p.numel() for c in chunks for p in c.parameters())
        layers = sum(len(c.decoder.layers) for c in chunks)
        assert stage.params - without.params == layers * cfg.model.num_attention_heads // tp


def test_model_total_keys_and_flops():
    cfg = _config()
    whole = GPTModel(cfg.model, LayerContext(None, False, torch.float32, torch.device("cpu"), 1))
    total = sum(p.numel() for p in whole.parameters())
    assert model_params(cfg) == (total, total)
    assert expected_keys(cfg.model) == set(whole.state_dict())
    assert "decoder.layers.3.self_attention.core_attention.softmax_offset" in expected_keys(cfg.model)
    full = dataclasses.replace(cfg, model=cfg.model.replaced(window_size=None, window_attn_skip_freq=None,
                                                             softmax_type="vanilla"))
    assert flops_per_iteration(cfg, 8) == flops_per_iteration(full, 8)
