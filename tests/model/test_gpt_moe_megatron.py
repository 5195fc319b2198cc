"""A whole GPTModel with MoE layers equals megatron-core 0.16.1's GPTModel (local spec, MoE block
spec from the same --moe-layer-freq pattern) for the same weights, in float64: the logits, the
logged balancing / z losses and every parameter gradient of the loss (with the attached balancing
losses) within 1e-12, with a shared expert, for both dispatchers at one rank.
The CPU workarounds are tests/helpers/mcore_moe.py's."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.moe.balancing import LossScale
from megafab.model.moe.router import routers_of
from megafab.model.moe.settings import MoESettings
from megafab.model.transformer import LayerContext
from tests.helpers.mcore_moe import megatron_losses, megatron_moe_on_cpu, set_megatron_loss_scale
from tests.helpers.tiny import LLAMA_STYLE, batch, tiny_config

PATTERN = (0, 1, 1, 1)  # --moe-layer-freq "([0]*1+[1]*3)"
MOE = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=PATTERN, moe_aux_loss_coeff=1e-2,
           moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=40, moe_ffn_hidden_size=24)
SCALE = 0.75  # the balancing losses' backward weight (grad scale * cp / micro-batches in training)


@pytest.fixture(scope="module")
def megatron_cpu():
    with megatron_moe_on_cpu():
        yield


def megatron_gpt(m, settings: MoESettings, dtype=torch.float64):
    """megatron-core's GPTModel (local spec) with the MoE layers the settings' pattern names."""
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    moe = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(settings).items()
           if k in fields and k != "moe_grouped_gemm"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
            kv_channels=m.kv_channels, normalization=m.normalization, layernorm_epsilon=m.norm_epsilon,
            gated_linear_unit=m.swiglu, activation_func=F.silu if m.swiglu else F.gelu,
            add_bias_linear=m.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, params_dtype=dtype, gradient_accumulation_fusion=False,
            bias_activation_fusion=False, num_moe_experts=settings.num_experts, **moe)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=m.normalization)
        model = McoreGPT(config, spec, vocab_size=m.padded_vocab_size,
                         max_sequence_length=m.max_position_embeddings, parallel_output=False,
                         share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                         position_embedding_type=m.position_embedding_type, rotary_percent=m.rotary_percent,
                         rotary_base=m.rotary_base).double()  # its norms are built in float32
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    megatron_losses()  # start the log empty
    torch.manual_seed(0)
    with torch.no_grad():  # norms and biases start at 1 / 0: give every tensor values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def megafab_gpt(m, settings: MoESettings, dtype=torch.float64) -> GPTModel:
    ctx = LayerContext(None, False, dtype, torch.device("cpu"), 1234, moe=settings,
                       moe_loss_scale=LossScale())
    return GPTModel(m, ctx)


def _causal_mask(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]


def _step(model, tokens, labels, mask, megatron: bool):
    """Logits [b, s, V] of a forward, then backward of the masked mean cross entropy (computed here:
    megatron-core's own loss casts the logits to float32)."""
    if megatron:
        set_megatron_loss_scale(SCALE)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, positions, _causal_mask(tokens.shape[1]))
    else:
        model.ctx.moe_loss_scale.set(SCALE)
        logits = model(tokens).transpose(0, 1)  # [s, b, V] -> [b, s, V]
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    masked_mean_loss(per_token, mask).backward()
    return logits.detach()


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_gpt_with_moe_layers_equals_megatron_core(megatron_cpu, dispatcher):
    # learned positions: megatron-core's RoPE angles are float32 (1e-9 apart from float64's)
    m = tiny_config(style={**LLAMA_STYLE, "position_embedding_type": "learned_absolute"}).model
    settings = MoESettings(**MOE, moe_token_dispatcher_type=dispatcher)
    theirs, ours = megatron_gpt(m, settings), megafab_gpt(m, settings)
    params = dict(ours.named_parameters())
    assert params.keys() == dict(theirs.named_parameters()).keys()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            params[name].copy_(p)
    assert [type(layer.mlp).__name__ for layer in ours.decoder.layers.values()] == \
        ["MLP", "MoELayer", "MoELayer", "MoELayer"]
    assert ours.decoder.layers["1"].mlp.shared_experts is not None
    tokens, labels, mask = batch(m)
    ref = _step(theirs, tokens, labels, mask, megatron=True)
    out = _step(ours, tokens, labels, mask, megatron=False)
    assert (ref - out).abs().max().item() < 1e-12
    for name, p in theirs.named_parameters():
        assert params[name].grad is not None, name
        assert (p.grad - params[name].grad).abs().max().item() < 1e-12, name
    ref_losses = megatron_losses()
    logged = {}
    for router in routers_of([ours]):
        for name, value in router.logged_losses.items():
            logged[name] = logged.get(name, 0.0) + value.item()
    assert ref_losses.keys() == logged.keys() == {"load_balancing_loss", "z_loss"}
    for name, value in ref_losses.items():
        assert abs(value - logged[name]) < 1e-12 * max(1.0, abs(value)), name
