"""megafab (name, box) <-> Megatron (key, box): layer stacking, TE norm names, SwiGLU's [gate; up]
rows, any flat range of a TP block; and the by-name TP split rule that legacy files are read with
agrees with the attributes megafab's layers give their parameters."""

import torch

from megafab.checkpoint import megatron_keys as mk
from megafab.checkpoint.layout import ParamLayout, model_key, optim_key
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel
from megafab.param_names import tp_partition
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, context, tiny_config


def test_names_stack_layers_and_take_transformer_engine_norm_names():
    assert mk.megatron_name("decoder.layers.3.input_layernorm.weight") == (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight", 3)
    assert mk.megatron_name("decoder.layers.0.pre_mlp_layernorm.bias") == (
        "decoder.layers.mlp.linear_fc1.layer_norm_bias", 0)
    assert mk.megatron_name("decoder.layers.1.mlp.linear_fc2.weight") == (
        "decoder.layers.mlp.linear_fc2.weight", 1)
    assert mk.megatron_name("embedding.word_embeddings.weight") == ("embedding.word_embeddings.weight", None)
    assert mk.megafab_name("decoder.layers.mlp.linear_fc1.layer_norm_weight", 2) == \
        "decoder.layers.2.pre_mlp_layernorm.weight"


def test_a_flat_range_of_a_strided_tp_block_lands_on_megatrons_gate_and_up_rows():
    cfg = tiny_config(style=LLAMA_STYLE).model  # 4 layers, SwiGLU
    f, h, layer = 6, 3, 2
    stored = torch.arange(2 * f * h, dtype=torch.float32).view(2, f, h)  # megafab's [2, f, h] view
    megatron = torch.zeros(cfg.num_layers, 2 * f, h)
    megatron[layer] = stored.view(2 * f, h)  # Megatron's [L, 2f, h]: the same bytes, stacked
    name = f"decoder.layers.{layer}.mlp.linear_fc1.weight"
    block = ParamLayout(name, (2, f, h), (0, f // 2, 0), (2, f // 2, h))  # TP rank 1 of 2
    lo, hi = 4, 16  # crosses the stride row: part of gate_1, all of the rest, part of up_1
    flat = stored[:, f // 2:].reshape(-1)[lo:hi].clone()
    for kind, key in ((None, model_key(block.name)), ("exp_avg", optim_key(block.name, "exp_avg"))):
        out = mk.to_megatron({key: block.shard(flat, lo, hi)}, cfg)
        name = "decoder.layers.mlp.linear_fc1.weight"
        [(mkey, shard)] = out.items()
        assert mkey == (name if kind is None else f"optimizer.state.exp_avg.{name}")
        assert shard.global_shape == (cfg.num_layers, 2 * f, h) and shard.numel() == hi - lo
        for box, view in zip(shard.boxes, shard.views):
            index = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))
            assert torch.equal(view, megatron[index]), box
            assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # views, no copies


def _tp_rule_matches_attributes(rank, world):
    topo = build_topology(tp=world)
    checked = 0
    for style in (GPT2_STYLE, LLAMA_STYLE):
        cfg = tiny_config(tp=world, style=style).model
        for name, p in GPTModel(cfg, context(topo.group("tp"))).named_parameters():
            split = getattr(p, "tensor_model_parallel", False)
            attrs = (p.partition_dim, p.partition_stride) if split else None
            assert tp_partition(name, cfg.swiglu) == attrs, name
            checked += 1
    return checked


def test_the_by_name_tp_rule_agrees_with_the_layers():
    assert run_ranks(_tp_rule_matches_attributes, 2, timeout=120)[0] > 30
