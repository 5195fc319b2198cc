"""Transformer Engine path: clear refusals where TE/FP8 cannot run, the local<->TE name mapping, and a
TE-vs-local parity test that runs only where transformer_engine and CUDA exist."""

import pytest
import torch

from megafab.model.gpt import GPTModel
from megafab.model.te import (
    TransformerEngineError,
    check_transformer_engine,
    local_to_te_name,
    te_available,
    te_to_local_name,
    to_local_state_dict,
    to_te_state_dict,
)
from tests.model.tiny import LLAMA_STYLE, context, reference_model, tiny_config


def test_transformer_engine_on_cpu_is_refused_before_training():
    cfg = tiny_config(transformer_impl="transformer_engine", bf16=True)
    with pytest.raises(TransformerEngineError, match="needs a CUDA GPU but this run is on cpu"):
        check_transformer_engine(cfg.model, cfg.precision, "cpu")


def test_fp8_on_cpu_is_refused_with_the_fix():
    cfg = tiny_config(transformer_impl="transformer_engine", bf16=True, fp8_format="hybrid")
    with pytest.raises(TransformerEngineError, match="--fp8-format needs a CUDA GPU") as err:
        check_transformer_engine(cfg.model, cfg.precision, "cpu")
    if not te_available():
        assert "transformer_engine, which is not installed" in str(err.value)


def test_fp8_without_transformer_engine_impl_is_a_config_error():
    with pytest.raises(ValueError, match="--fp8-format needs --transformer-impl transformer_engine"):
        tiny_config(bf16=True, fp8_format="e4m3")


def test_local_implementation_needs_nothing():
    cfg = tiny_config()
    check_transformer_engine(cfg.model, cfg.precision, "cpu")  # no error


def test_driver_refuses_te_before_any_process_group():
    from megafab.training.build import init_distributed

    cfg = tiny_config(transformer_impl="transformer_engine", bf16=True, distributed_backend="gloo")
    with pytest.raises(TransformerEngineError):
        init_distributed(cfg)
    assert not torch.distributed.is_initialized()


def test_parameter_names_map_both_ways():
    assert local_to_te_name("decoder.layers.3.input_layernorm.weight") == \
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert local_to_te_name("decoder.layers.0.pre_mlp_layernorm.bias") == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_bias"
    assert te_to_local_name("decoder.layers.0.self_attention.core_attention._extra_state") is None
    for style in ({}, LLAMA_STYLE):
        names = list(reference_model(tiny_config(**({"style": style} if style else {})).model).state_dict())
        te_names = [local_to_te_name(n) for n in names]
        assert len(set(te_names)) == len(names)
        assert [te_to_local_name(n) for n in te_names] == names
        assert "decoder.final_layernorm.weight" in te_names  # the final norm stays a separate module
    state = reference_model(tiny_config().model).state_dict()
    te_state = to_te_state_dict(state)
    te_state["decoder.layers.0.mlp.linear_fc1._extra_state"] = None
    back = to_local_state_dict(te_state)
    assert back.keys() == state.keys() and all(back[k] is state[k] for k in state)


@pytest.mark.skipif(not (te_available() and torch.cuda.is_available()),
                    reason="needs transformer_engine and a CUDA GPU (neither is on the CPU CI machine)")
def test_te_layers_equal_local_layers_on_gpu():
    device = torch.device("cuda")
    for style in ({}, LLAMA_STYLE):
        kwargs = {"style": style} if style else {}
        local_cfg = tiny_config(bf16=True, **kwargs).model
        te_cfg = tiny_config(bf16=True, transformer_impl="transformer_engine", **kwargs).model
        ctx = context(dtype=torch.float32)
        ctx.device = device
        local, te_model = GPTModel(local_cfg, ctx), GPTModel(te_cfg, ctx)
        te_model.load_state_dict(to_te_state_dict(local.state_dict()), strict=False)
        tokens = torch.randint(0, local_cfg.vocab_size, (2, local_cfg.seq_length), device=device)
        a, b = local(tokens).float(), te_model(tokens).float()
        assert (a - b).abs().max().item() < 1e-3 * a.abs().max().item()
