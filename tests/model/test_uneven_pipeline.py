"""Uneven pipeline splits (--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-
in-pipeline-split): the same layer placement as megatron-core, and the same math as one process."""

import functools
import warnings

import pytest
import torch

from megafab.config import ConfigError
from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.pipeline import get_forward_backward_func
from megafab.distributed.topology import build_topology
from megafab.model.gpt import WORD_EMBEDDING, build_model_chunks, masked_mean_loss
from megafab.pipeline_split import PipelineSplit
from megafab.run.fork_ranks import run_ranks
from tests.helpers.flags import tiny_flags
from tests.helpers.tiny import (
    GPT2_STYLE,
    LLAMA_STYLE,
    batch,
    context,
    forward_step,
    reference_model,
    tiny_config,
)

# (num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss)
SPLITS = [
    (7, 3, 1, 1, None, False, False), (7, 3, 1, None, 3, False, False), (8, 3, 1, 2, 2, False, False),
    (5, 2, 1, 2, None, False, False), (10, 3, 2, 2, 4, False, False), (14, 4, 2, 2, None, False, False),
    (7, 4, 1, None, None, True, False), (7, 4, 1, None, None, False, True), (6, 4, 1, None, None, True, True),
    (7, 2, 2, None, None, True, False), (6, 2, 2, None, None, True, True),
    (8, 4, 1, None, None, False, False),
    (8, 2, 2, None, None, False, False),
]


def _megatron_placement(n, pp, vpp, first, last, emb, loss):
    """[(pp_rank, chunk) -> (offset, layers)] from megatron-core 0.16.1's own functions."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = TransformerConfig(
            num_layers=n, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, pipeline_dtype=torch.float32,
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
    vp = (lambda c: c) if vpp > 1 else (lambda c: None)
    return {(r, c): (get_transformer_layer_offset(cfg, vp(c), r),
                     get_num_layers_to_build(cfg, vp(c), r)) for r in range(pp) for c in range(vpp)}


@pytest.mark.parametrize("split", SPLITS, ids=[str(s) for s in SPLITS])
def test_layer_placement_equals_megatron_core(split):
    ours = PipelineSplit(*split)
    assert ours.problems() == []
    placement = _megatron_placement(*split)
    for (rank, chunk), (offset, layers) in placement.items():
        assert ours.layer_range(rank, chunk) == (offset, offset + layers), (rank, chunk)
    covered = sorted(i for r, c in placement for i in range(*ours.layer_range(r, c)))
    assert covered == list(range(split[0]))  # every layer exactly once


def test_impossible_splits_are_named_together_with_the_other_problems():
    from megafab.arguments import config_from_args

    argv = tiny_flags(num_layers=7) + [
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "64",
        "--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "2",
        "--account-for-loss-in-pipeline-split", "--fp16", "--bf16"]
    with pytest.raises(ConfigError) as info:
        config_from_args(argv, world_size=3)
    text = str(info.value)
    assert "cannot be combined with --account-for-embedding/loss-in-pipeline-split" in text
    assert "--fp16 and --bf16" in text
    problems = PipelineSplit(7, 3, first=2).problems()
    assert problems and "5 layers left for the 2 middle" in problems[0]


def _uneven_parity(rank, world, layouts):
    checked = []
    for pp, vpp, flat, style in layouts:
        topo = build_topology(tp=1, pp=pp, vpp=vpp)
        cfg = tiny_config(pp=pp, style=style, num_layers=flat.pop("num_layers"), **flat)
        split = PipelineSplit.from_config(cfg)
        model_cfg = cfg.model
        batches = [batch(model_cfg, seed=i) for i in range(4)]
        ref = reference_model(model_cfg)
        ref_loss = sum(masked_mean_loss(ref(t, labels=lab), m) for t, lab, m in batches) / len(batches)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        chunks = build_model_chunks(model_cfg, context(), pp, topo.pp_rank, vpp, split)
        logs = get_forward_backward_func(pp, vpp)(
            forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
            model=chunks if vpp > 1 else chunks[0], num_microbatches=4, seq_length=model_cfg.seq_length,
            micro_batch_size=2, hidden_size=model_cfg.hidden_size, topology=topo, dtype=torch.float64,
            finalize_model_grads_func=functools.partial(finalize_model_grads, topology=topo))
        if topo.is_last_stage:
            loss = sum(log["lm loss"].item() for log in logs) / len(logs)
            assert abs(loss - ref_loss.item()) < 1e-10
        layers = set()
        for chunk in chunks:
            layers |= {int(n) for n in chunk.decoder.layers}
            for name, p in chunk.named_parameters():
                ref_name = WORD_EMBEDDING if name == "output_layer.weight" and \
                    not model_cfg.untie_embeddings_and_output_weights else name
                assert (p.grad - ref_grads[ref_name]).abs().max() < 1e-10, (pp, vpp, flat, name)
        checked.append(sorted(layers))
    return checked


PP3 = [
    (3, 1, dict(num_layers=5, decoder_first_pipeline_num_layers=1), GPT2_STYLE),
    (3, 1, dict(num_layers=5, decoder_last_pipeline_num_layers=3), LLAMA_STYLE),
    (3, 1, dict(num_layers=4, account_for_embedding_in_pipeline_split=True,
                account_for_loss_in_pipeline_split=True), GPT2_STYLE),
]
PP2_VPP2 = [
    (2, 2, dict(num_layers=7, num_virtual_stages_per_pipeline_rank=2, global_batch_size=8,
                account_for_embedding_in_pipeline_split=True), LLAMA_STYLE),
    (2, 2, dict(num_layers=6, num_virtual_stages_per_pipeline_rank=2, global_batch_size=8,
                decoder_first_pipeline_num_layers=2), GPT2_STYLE),
]


@pytest.mark.parametrize("world,layouts,first_stage,last_stage", [
    (3, PP3, [[0], [0], [0]], [[3, 4], [2, 3, 4], [3]]),
    # chunk-major order: (chunk 0, rank 0), (chunk 0, rank 1), (chunk 1, rank 0), (chunk 1, rank 1)
    (2, PP2_VPP2, [[0, 3, 4], [0, 3]], [[1, 2, 5, 6], [1, 2, 4, 5]]),
], ids=["pp3", "pp2-vpp2"])
def test_uneven_pipelines_equal_one_process(world, layouts, first_stage, last_stage):
    checked = run_ranks(_uneven_parity, world, layouts, timeout=240)
    assert checked[0] == first_stage and checked[-1] == last_stage


@pytest.mark.parametrize("pp,flat", [
    (3, dict(num_layers=5, decoder_first_pipeline_num_layers=1, qk_layernorm=True)),
    (2, dict(num_layers=7, num_virtual_stages_per_pipeline_rank=2, global_batch_size=8,
             account_for_embedding_in_pipeline_split=True))])
def test_planner_counts_the_parameters_each_uneven_stage_builds(pp, flat):
    from megafab.plan.planner import stage_params

    cfg = tiny_config(pp=pp, style=LLAMA_STYLE, **flat)
    split = PipelineSplit.from_config(cfg)
    for rank in range(split.pp):
        chunks = build_model_chunks(cfg.model, context(dtype=torch.float32), split.pp, rank, split.vpp, split)
        assert stage_params(cfg, rank) == sum(p.numel() for c in chunks for p in c.parameters()), rank
