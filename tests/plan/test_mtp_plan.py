"""The estimator counts multi-token prediction as the engine builds it: the planned parameters of
every pipeline stage (TP 1 and 2, PP 1 and 2, VPP) equal the chunks build_model_chunks builds (the
last stage's embedding copy and mtp.layers.* included), the model total equals the one-process
model's, the checkpoint keys are its state dict's (mtp.layers.<i>.*), each depth adds its
eh_proj, a layer, attention and logits to the FLOPs (Megatron's num_floating_point_operations), and
the activations each depth adds to the last stage are what autograd keeps (float32, CPU kernels)."""

import dataclasses

import pytest
import torch

from megafab.convert.state_dict import expected_keys
from megafab.distributed.sized_group import SizedGroup
from megafab.model.gpt import GPTModel, build_model_chunks, masked_mean_loss
from megafab.model.transformer import LayerContext
from megafab.optim.memory import SavedActivations
from megafab.pipeline_split import PipelineSplit
from megafab.plan.flops import flops_per_iteration
from megafab.plan.optimizer_tensors import chunk_tensors
from megafab.plan.params import model_params
from megafab.plan.planner import plan
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, batch, context, tiny_config

TIED = dict(LLAMA_STYLE, untie_embeddings_and_output_weights=False)


def _config(tp=1, pp=1, style=LLAMA_STYLE, **overrides):
    return tiny_config(tp=tp, pp=pp, style=style, sequence_parallel=tp > 1, global_batch_size=2 * pp,
                       **overrides)


@pytest.mark.parametrize("tp,pp,style,overrides", [
    (1, 1, LLAMA_STYLE, {}), (2, 1, TIED, {}), (1, 2, LLAMA_STYLE, {}), (2, 2, TIED, {}),
    (1, 2, TIED, dict(num_layers_per_virtual_pipeline_stage=1)),
], ids=["tp1", "tp2-tied", "pp2", "tp2-pp2-tied", "pp2-vpp2-tied"])
def test_planned_parameters_equal_the_built_chunks_with_mtp(tp, pp, style, overrides):
    cfg = _config(tp, pp, style, mtp_num_layers=2, **overrides)
    split = PipelineSplit.from_config(cfg)
    for stage in plan(cfg):
        for tp_rank in sorted({0, tp - 1}):
            ctx = LayerContext(SizedGroup(tp, tp_rank), tp > 1, torch.float32, torch.device("cpu"), 1)
            chunks = build_model_chunks(cfg.model, ctx, split.pp, stage.pp_rank, split.vpp, split,
                                        on_meta=True)
            params = [p for c in chunks for p in c.parameters()]
            assert stage.params == sum(p.numel() for p in params), (stage.pp_rank, tp_rank)
            for c, chunk in enumerate(chunks):
                planned = chunk_tensors(cfg, stage.pp_rank, c)
                assert [t.numel for t in planned] == [p.numel() for p in chunk.parameters()]
                assert [t.shared_embedding for t in planned] == \
                    [getattr(p, "shared_embedding", False) for p in chunk.parameters()]
        holds_mtp = any(n.startswith("mtp.layers.1.") for c in chunks for n, _ in c.named_parameters())
        assert holds_mtp == (stage.pp_rank == pp - 1)
    # the MTP layers are counted: without them the last stage plans fewer parameters
    with_mtp = plan(cfg)
    without = plan(dataclasses.replace(cfg, model=cfg.model.replaced(mtp_num_layers=None)))
    assert with_mtp[-1].params > without[-1].params
    assert pp == 1 or with_mtp[0].params == without[0].params


@pytest.mark.parametrize("style", [LLAMA_STYLE, TIED])
def test_model_total_and_checkpoint_keys_include_mtp(style):
    cfg = _config(style=style, mtp_num_layers=2)
    whole = GPTModel(cfg.model, LayerContext(None, False, torch.float32, torch.device("cpu"), 1))
    total = sum(p.numel() for p in whole.parameters())
    assert model_params(cfg) == (total, total)
    keys = set(whole.state_dict())
    assert expected_keys(cfg.model) == keys
    assert {"mtp.layers.1.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
            "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight"} <= keys


def test_each_mtp_depth_adds_a_layer_eh_proj_and_logits_to_the_flops():
    batch = 8
    cfg = _config()
    m = cfg.model
    plain = flops_per_iteration(cfg, batch)
    one_more_layer = flops_per_iteration(_config(num_layers=m.num_layers + 1), batch) - plain
    for depths in (1, 3):
        with_mtp = flops_per_iteration(_config(mtp_num_layers=depths), batch)
        per_depth = one_more_layer + 3 * 2 * batch * m.seq_length * m.hidden_size * (
            m.padded_vocab_size + 2 * m.hidden_size)  # logits, eh_proj [h, 2h]
        assert with_mtp - plain == pytest.approx(depths * per_depth, rel=1e-12)


def _saved_bytes(cfg) -> int:
    m = cfg.model
    model = GPTModel(m, context(dtype=torch.float32))
    tokens, labels, mask = batch(m)
    with SavedActivations(model.parameters()) as saved:
        loss = masked_mean_loss(model(tokens, labels=labels, loss_mask=mask.float()), mask.float())
    loss.backward()
    return saved.bytes


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "full-uniform"])
@pytest.mark.parametrize("style", [LLAMA_STYLE, GPT2_STYLE], ids=["llama", "gpt2"])
def test_each_mtp_depth_adds_the_activations_autograd_keeps(style, recompute):
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)

    def config(depths):
        return tiny_config(style=style, mtp_num_layers=depths, micro_batch_size=2, global_batch_size=2,
                           **(full if recompute else {}))

    measured = [_saved_bytes(config(d)) for d in (None, 1, 2)]
    planned = [plan(config(d), kernels="cpu")[-1].forward_saved_bytes for d in (None, 1, 2)]
    per_depth = planned[1] - planned[0]
    assert planned[2] - planned[1] == per_depth > 0
    for depths in (1, 2):
        assert planned[depths] - planned[0] == pytest.approx(measured[depths] - measured[0], rel=0.05)


def test_the_step_time_model_runs_each_mtp_depth_on_the_last_stage():
    """Each depth: its embedding, eh_proj's GEMMs, a layer of the last layer's kind, the output
    layer and loss, forward and backward, on the last stage only."""
    from megafab.plan.layer_time import Shapes, embedding_pass, layer_passes, output_pass
    from megafab.plan.machines import machine
    from megafab.plan.step_time import stage_passes

    h100 = machine("h100-sxm-80gb")
    plain = stage_passes(_config(pp=2), h100)
    x = Shapes(_config(pp=2), h100)
    layer, output, embedding = layer_passes(_config(pp=2), h100), output_pass(x, False), embedding_pass(x)
    eh_proj = (x.gemm(x.M, x.h, 2 * x.h), x.gemm(x.M, 2 * x.h, x.h) + x.gemm(2 * x.h, x.h, x.M))
    assert min(eh_proj) > 0
    for depths in (1, 2):
        passes = stage_passes(_config(pp=2, mtp_num_layers=depths), h100)
        assert passes[0][0].total == plain[0][0].total and passes[0][1].total == plain[0][1].total
        for i in (0, 1):  # forward, backward
            added = passes[1][i].total - plain[1][i].total
            per_depth = layer[i].total + output[i].total + embedding[i].total + eh_proj[i]
            assert added == pytest.approx(depths * per_depth, rel=1e-9) and added > 0
