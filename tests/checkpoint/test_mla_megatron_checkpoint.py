"""Megatron torch_dist checkpoints of DeepSeek-V3's shape in small (multi-latent attention with a query
LoRA and YaRN, a dense first layer then MoE layers with a shared expert, sigmoid group routing with
the expert bias, one MTP layer; tests/helpers/mcore_deepseek.py), megatron-core 0.16.1 as the oracle
(local spec, float64): its dist_checkpointing.save loads into megafab with every tensor equal and
megatron-core's logits; megafab's save loads strictly into megatron-core (every key its
sharded_state_dict asks for: the unfused input_layernorm / pre_mlp_layernorm of the MLA spec, MLA's
projections' `_extra_state`) with megafab's values. Megafab's MLA keys against megatron-core's
Transformer Engine spec names (the latent norms fused into the up projections) are checked by name.
"""

from __future__ import annotations

import types

import torch

from megafab.checkpoint import checkpointing
from megafab.checkpoint import megatron_keys as mk
from megafab.checkpoint.megatron_args import megatron_namespace
from megafab.checkpoint.state import named_parameters
from megafab.run.fork_ranks import run_ranks
from tests.helpers import mcore
from tests.helpers.checkpoint import full_logits
from tests.helpers.mcore_deepseek import deepseek_config, deepseek_state, megatron_deepseek
from tests.helpers.mcore_moe import megatron_moe_on_cpu


def _tokens(m):
    return torch.randint(0, m.vocab_size, (2, m.seq_length), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def _mcore_logits(model, tokens):
    """megatron-core's main logits [b, s, V]: the last output-layer call of a forward with labels
    (its MTP block needs them), the MTP depth's coming first."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from tests.helpers.mcore_mtp import recording

    MTPLossLoggingHelper.tracker.clear()
    MTPLossLoggingHelper.tracker["values"] = torch.zeros(1, dtype=torch.float64)
    calls, forward = [], model.output_layer.forward
    model.output_layer.forward = recording(forward, calls)
    s = tokens.shape[1]
    model(tokens, torch.arange(s).expand_as(tokens), mcore.causal_mask(s), labels=tokens)
    model.output_layer.forward = forward
    return calls[-1].transpose(0, 1)


def _tensors(model) -> list:
    return list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                             if n.endswith("expert_bias")]


def _values(model) -> dict:
    return {n: t.detach().clone() for n, t in _tensors(model)}


def _mcore_save(rank, world, root):
    cfg = deepseek_config()
    with megatron_moe_on_cpu():
        mcore.cpu_workarounds()
        model = megatron_deepseek(cfg, seed=7)
        record = types.SimpleNamespace(iteration=10, counters=None, has_optimizer=False, has_rng=False)
        mcore.save(model, root, common={"args": megatron_namespace(cfg, record, "torch_dist"),
                                        "iteration": 10, "checkpoint_version": 3.0})
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        keys = {v.key for v in nested_values(model.sharded_state_dict())}
        return _values(model), _mcore_logits(model, _tokens(cfg.model)), keys


def _megafab(rank, world, root, save: bool):
    where = {"save": root} if save else {"load": root, "finetune": True}
    state = deepseek_state(**where)
    if save:
        g = torch.Generator().manual_seed(5)  # one rank: every weight and expert bias off its init
        with torch.no_grad():
            for _, t in _tensors(state.model[0].module):
                t.add_(torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype) * 0.05)
        checkpointing.save_checkpoint(state)
    else:
        assert checkpointing.load_checkpoint(state) == 10
    logits = full_logits(state, _tokens(state.cfg.model))
    return _values(state.model[0].module), logits, [n for n, _ in named_parameters(state)]


def _mcore_load(rank, world, path):
    with megatron_moe_on_cpu():
        mcore.cpu_workarounds()
        model = megatron_deepseek(deepseek_config(), seed=99)
        mcore.load(model, path)
        return _values(model)


def test_megatron_core_mla_moe_mtp_checkpoint_loads_into_megafab_with_its_logits(tmp_path):
    root = str(tmp_path / "mcore")
    theirs, their_logits, keys = run_ranks(_mcore_save, 1, root, timeout=240)[0]
    # the MLA local spec's keys (per layer: dense and MoE layers mixed): norms unfused, MLA's
    # projections, an MoE layer's router, the MTP layer
    for key in ("decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
                "decoder.layers.2.pre_mlp_layernorm.weight",
                "decoder.layers.1.self_attention.linear_q_up_proj.weight",
                "decoder.layers.3.self_attention.kv_layernorm.weight",
                "decoder.layers.0.self_attention.linear_kv_down_proj._extra_state",
                "decoder.layers.1.mlp.router.expert_bias",
                "mtp.layers.0.transformer_layer.input_layernorm.weight"):
        assert key in keys, (key, sorted(keys))
    assert not any("linear_qkv" in k for k in keys)
    ours, logits, _ = run_ranks(_megafab, 1, root, False, timeout=240)[0]
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name
    assert logits.shape == their_logits.shape
    err = (logits - their_logits).abs().max().item()
    assert err < 1e-5 and their_logits.std() > 0.1, err
    print(f"MEASURED logits max abs err {err!r}")


def test_megafab_mla_moe_mtp_checkpoint_loads_strictly_into_megatron_core(tmp_path):
    root = str(tmp_path / "megafab")
    ours, _, _ = run_ranks(_megafab, 1, root, True, timeout=240)[0]
    theirs = run_ranks(_mcore_load, 1, str(tmp_path / "megafab" / "iter_0000000"), timeout=240)[0]
    assert theirs.keys() == ours.keys()
    assert any(k.endswith("expert_bias") and (v != 0).any() for k, v in ours.items())
    for name, value in ours.items():
        assert torch.equal(theirs[name], value), name


def test_mla_keys_are_megatron_cores_in_either_spec():
    cfg = deepseek_config().model
    mla = mk.is_mla(cfg)
    assert mla
    assert mk.megatron_name("decoder.layers.2.input_layernorm.weight", mla) == (
        "decoder.layers.input_layernorm.weight", 2)
    assert mk.megatron_name("decoder.layers.0.pre_mlp_layernorm.weight", mla) == (
        "decoder.layers.pre_mlp_layernorm.weight", 0)
    # a standard attention model keeps the Transformer Engine names its local spec maps to
    assert mk.megatron_name("decoder.layers.2.input_layernorm.weight")[0] == \
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    # reading megatron-core's Transformer Engine spec: the latent norms fused into the up projections,
    # a dense layer's pre-MLP norm into linear_fc1
    te_keys = {"decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight",
               "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight",
               "decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.input_layernorm.weight"}
    assert mk._stored_name("decoder.layers.1.self_attention.q_layernorm.weight", te_keys, mla) == (
        "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight", 1)
    assert mk._stored_name("decoder.layers.1.self_attention.kv_layernorm.weight", te_keys, mla) == (
        "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight", 1)
    assert mk._stored_name("decoder.layers.0.pre_mlp_layernorm.weight", te_keys, mla) == (
        "decoder.layers.mlp.linear_fc1.layer_norm_weight", 0)
    assert mk._stored_name("decoder.layers.0.input_layernorm.weight", te_keys, mla) == (
        "decoder.layers.input_layernorm.weight", 0)
    per_layer = {"decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight",
                 "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"}  # non_homogeneous_layers' keys
    assert mk._stored_name("decoder.layers.1.self_attention.q_layernorm.weight", per_layer, mla) == (
        "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight", 1)
    assert mk._stored_name("decoder.layers.0.pre_mlp_layernorm.weight", per_layer, mla) == (
        "decoder.layers.mlp.linear_fc1.layer_norm_weight", 0)
    assert mk.megafab_name("decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight", 3) == \
        "decoder.layers.3.self_attention.kv_layernorm.weight"
    assert mk.megafab_name("mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.layer_norm_weight",
                           None) == "mtp.layers.0.transformer_layer.self_attention.q_layernorm.weight"
    # MLA's linear modules' _extra_state, with and without a query LoRA
    assert mk.attention_modules(cfg) == tuple("self_attention." + m for m in (
        "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"))
    direct = deepseek_config(q_lora_rank=None).model
    assert mk.attention_modules(direct)[0] == "self_attention.linear_q_proj"
