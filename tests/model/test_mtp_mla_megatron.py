"""DeepSeek-V3's shape in small: a GPT with multi-latent attention (query LoRA, YaRN), a dense first
layer, an MoE last layer (shared expert, sigmoid group routing with expert bias) and one MTP layer
(an MLA + MoE layer too) equals megatron-core 0.16.1's GPTModel with its MTP block, float64 within
1e-12: the main and MTP logits, the main loss, the logged MTP loss, the balancing losses and every
gradient. Test-only shims: tests/helpers/mcore_moe.py's CPU patches, tests/helpers/mcore_mla.py's
core attention and float64 RoPE, tests/helpers/mcore_mtp.py's exact cross entropy."""

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
from tests.helpers.mcore_mla import MLA_STYLE, MathCoreAttention, to_float64_rope
from tests.helpers.mcore_moe import megatron_losses, megatron_moe_on_cpu, set_megatron_loss_scale
from tests.helpers.mcore_mtp import FACTOR, MOE, SCALE, exact_cross_entropy, recording
from tests.helpers.tiny import batch, tiny_config


@pytest.fixture(scope="module")
def megatron_cpu():
    with megatron_moe_on_cpu():
        yield


def megatron_gpt(m, settings: MoESettings):
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    moe = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(settings).items()
           if k in fields and k != "moe_grouped_gemm"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = MLATransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            ffn_hidden_size=m.ffn_hidden_size, normalization=m.normalization,
            layernorm_epsilon=m.norm_epsilon,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
            attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float64,
            gradient_accumulation_fusion=False, bias_activation_fusion=False, qk_layernorm=m.qk_layernorm,
            q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
            qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
            rope_type=m.rope_type or "yarn",
            rotary_base=m.rotary_base, rotary_percent=m.rotary_percent,
            rotary_scaling_factor=m.rotary_scaling_factor, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim,
            apply_rope_fusion=False, mtp_num_layers=1, mtp_loss_scaling_factor=FACTOR,
            num_moe_experts=settings.num_experts, **moe)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=m.normalization)
        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = MathCoreAttention
        have_te = multi_latent_attention.HAVE_TE
        multi_latent_attention.HAVE_TE = False
        mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        try:
            model = McoreGPT(config, spec, vocab_size=m.padded_vocab_size,
                             max_sequence_length=m.max_position_embeddings, parallel_output=False,
                             share_embeddings_and_output_weights=False, position_embedding_type="rope",
                             rotary_percent=m.rotary_percent, rotary_base=m.rotary_base,
                             mtp_block_spec=mtp)
        finally:
            multi_latent_attention.HAVE_TE = have_te
    model = model.double()
    for module in model.modules():
        if hasattr(module, "rotary_pos_emb") and module.rotary_pos_emb is not None:
            to_float64_rope(module.rotary_pos_emb, m.rotary_base)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_gpt_with_mla_moe_and_mtp_equals_megatron_core(megatron_cpu, monkeypatch):
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    m = tiny_config(style=MLA_STYLE, num_layers=2, mtp_num_layers=1, mtp_loss_scaling_factor=FACTOR).model
    settings = MoESettings(**MOE)
    monkeypatch.setattr(tensor_parallel, "vocab_parallel_cross_entropy", exact_cross_entropy)
    theirs = megatron_gpt(m, settings)
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    megatron_losses()
    ours = GPTModel(m, LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, moe=settings,
                                    moe_loss_scale=LossScale()))
    params = dict(ours.named_parameters())
    assert params.keys() == dict(theirs.named_parameters()).keys()
    assert {"mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight",
            "mtp.layers.0.transformer_layer.mlp.router.weight"} <= params.keys()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            params[name].copy_(p)
    tokens, labels, mask = batch(m)
    s = tokens.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    ref_logits, our_logits = [], []
    theirs.output_layer.forward = recording(theirs.output_layer.forward, ref_logits)
    ours.logits = recording(ours.logits, our_logits)
    MTPLossLoggingHelper.tracker.clear()
    MTPLossLoggingHelper.tracker["values"] = torch.zeros(1, dtype=torch.float64)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(SCALE, dtype=torch.float64))
    set_megatron_loss_scale(SCALE)
    ref = theirs(tokens, torch.arange(s).expand_as(tokens), causal, labels=labels, loss_mask=mask)
    masked_mean_loss(ref, mask).backward()
    ref_logged = MTPLossLoggingHelper.tracker["values"].clone()
    MTPLossLoggingHelper.tracker.clear()
    ours.mtp.loss_scale.set(SCALE)
    ours.ctx.moe_loss_scale.set(SCALE)
    loss = ours(tokens, labels=labels, loss_mask=mask)
    masked_mean_loss(loss, mask).backward()
    assert len(ref_logits) == len(our_logits) == 2
    for a, b in zip(ref_logits, our_logits):
        assert (a - b).abs().max().item() < 1e-12
    assert (ref - loss).abs().max().item() < 1e-12
    assert (ours.mtp.take_logged_losses() - ref_logged).abs().max().item() < 1e-12
    for name, p in theirs.named_parameters():
        assert params[name].grad is not None, name
        assert (p.grad - params[name].grad).abs().max().item() < 1e-12, name
    balancing, logged = megatron_losses(), {}
    for router in routers_of([ours]):
        for name, value in router.logged_losses.items():
            logged[name] = logged.get(name, 0.0) + value.item()
    assert len(routers_of([ours])) == 2 and balancing.keys() == logged.keys() and balancing
    for name, value in balancing.items():
        assert abs(value - logged[name]) < 1e-12 * max(1.0, abs(value)), name
