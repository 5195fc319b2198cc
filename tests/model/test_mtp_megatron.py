"""A GPT with multi-token prediction equals megatron-core 0.16.1's GPTModel with its MTP block
(local spec, get_gpt_mtp_block_spec) for the same weights, in float64 within 1e-12: the main and
every depth's logits, the main per-token loss, each depth's logged MTP loss, and every gradient of
the masked-mean main loss with the MTP losses attached at a backward weight other than 1; one and
two depths, tied and untied output layers, RoPE and learned positions; an MoE model whose MTP
layer is an MoE layer (its balancing losses too); and the torch_dist keys megafab writes.
Test-only shims: tests/helpers/mcore_moe.py's CPU patches, megatron-core's vocab-parallel cross
entropy (it upcasts to float32) replaced by the exact one at one rank, and its MTP loss tracker
seeded with a float64 tensor (it makes a float32 one), its RoPE frequencies computed in float64.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from megafab.model.gpt import GPTModel, masked_mean_loss
from tests.helpers.mcore_moe import megatron_moe_on_cpu
from tests.helpers.mcore_mtp import FACTOR, MOE, SCALE, exact_cross_entropy, recording
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, batch, reference_model, tiny_config


@pytest.fixture(scope="module")
def megatron_cpu():
    with megatron_moe_on_cpu():
        yield


def megatron_gpt(m, dtype=torch.float64, per_token=False):
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
            kv_channels=m.kv_channels, normalization=m.normalization, layernorm_epsilon=m.norm_epsilon,
            gated_linear_unit=m.swiglu, activation_func=F.silu if m.swiglu else F.gelu,
            add_bias_linear=m.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, params_dtype=dtype, gradient_accumulation_fusion=False,
            bias_activation_fusion=False, mtp_num_layers=m.mtp_num_layers,
            mtp_loss_scaling_factor=m.mtp_loss_scaling_factor, calculate_per_token_loss=per_token)
        spec = get_gpt_layer_local_spec(normalization=m.normalization)
        model = McoreGPT(config, spec, vocab_size=m.padded_vocab_size,
                         max_sequence_length=m.max_position_embeddings, parallel_output=False,
                         share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                         position_embedding_type=m.position_embedding_type, rotary_percent=m.rotary_percent,
                         rotary_base=m.rotary_base,
                         mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    model = model.double()  # its norms are built in float32
    torch.manual_seed(0)
    with torch.no_grad():  # norms and biases start at 1 / 0: give every tensor values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


CASES = {
    "llama-1": (LLAMA_STYLE, 1),  # RoPE, RMSNorm, SwiGLU, untied
    "llama-2": (LLAMA_STYLE, 2),
    "gpt2-2": (GPT2_STYLE, 2),  # learned positions (rolled for MTP's embedding), LayerNorm, tied
}


@pytest.mark.parametrize("case", CASES)
def test_gpt_with_mtp_equals_megatron_core(megatron_cpu, monkeypatch, case):
    from megatron.core import tensor_parallel
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    style, depths = CASES[case]
    m = tiny_config(style=style, num_layers=2, mtp_num_layers=depths, mtp_loss_scaling_factor=FACTOR).model
    monkeypatch.setattr(tensor_parallel, "vocab_parallel_cross_entropy", exact_cross_entropy)
    theirs, ours = megatron_gpt(m), reference_model(m)
    if ours.rotary is not None:  # megatron-core's RoPE frequencies are float32: give it the float64 ones
        theirs.rotary_pos_emb.inv_freq = ours.rotary.inv_freq.clone()
    params = dict(ours.named_parameters())
    assert params.keys() == dict(theirs.named_parameters()).keys()
    assert any(n.startswith(f"mtp.layers.{depths - 1}.eh_proj") for n in params)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            params[name].copy_(p)
    tokens, labels, mask = batch(m)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    s = tokens.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]

    ref_logits = []
    theirs.output_layer.forward = recording(theirs.output_layer.forward, ref_logits)
    MTPLossLoggingHelper.tracker.clear()
    MTPLossLoggingHelper.tracker["values"] = torch.zeros(depths, dtype=torch.float64)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(SCALE, dtype=torch.float64))
    ref_loss = theirs(tokens, positions, causal, labels=labels, loss_mask=mask)
    masked_mean_loss(ref_loss, mask).backward()
    ref_logged = MTPLossLoggingHelper.tracker["values"].clone()
    MTPLossLoggingHelper.tracker.clear()

    our_logits = []
    ours.logits = recording(ours.logits, our_logits)
    ours.mtp.loss_scale.set(SCALE)
    loss = ours(tokens, labels=labels, loss_mask=mask)
    masked_mean_loss(loss, mask).backward()

    assert len(our_logits) == len(ref_logits) == depths + 1  # each depth's, then the main logits
    for ref, out in zip(ref_logits, our_logits):
        assert (ref - out).abs().max().item() < 1e-12
    assert (ref_loss - loss).abs().max().item() < 1e-12
    logged = ours.mtp.take_logged_losses()
    assert logged.shape == (depths,) and (logged - ref_logged).abs().max().item() < 1e-12
    assert ours.mtp.take_logged_losses() is None  # the log starts over
    for name, p in theirs.named_parameters():
        assert params[name].grad is not None, name
        assert (p.grad - params[name].grad).abs().max().item() < 1e-12, name
    # the MTP losses reach the gradients: the MTP parameters' and more than the main loss alone's
    assert params["mtp.layers.0.eh_proj.weight"].grad.abs().sum() > 0


@pytest.mark.parametrize("style", [LLAMA_STYLE, GPT2_STYLE], ids=["llama", "gpt2"])
def test_torch_dist_keys_and_shapes_are_megatron_cores(megatron_cpu, style):
    """What megatron-core's sharded_state_dict names each tensor (mtp.layers.<i>.* per depth, not
    stacked; the MTP layer's norms under Transformer Engine's fused names as the decoder's) and each
    MTP module's `_extra_state` object is what megafab's torch_dist writes."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from megafab.checkpoint.megatron_dist import mtp_extra_state_objects
    from megafab.checkpoint.megatron_keys import megatron_name

    m = tiny_config(style=style, num_layers=2, mtp_num_layers=2).model
    theirs = megatron_gpt(m)
    sharded = theirs.sharded_state_dict().values()
    ref = {v.key: tuple(v.global_shape) for v in sharded if isinstance(v, ShardedTensor)}
    factories = {v.key for v in sharded if isinstance(v, ShardedTensorFactory)}  # SwiGLU's fc1 halves
    objects = {v.unique_key for v in sharded if isinstance(v, ShardedObject) and v.key.startswith("mtp.")}
    assert objects and objects == set(mtp_extra_state_objects(m))  # the `_extra_state` megafab writes
    ours = {}
    for name, p in reference_model(m).named_parameters():
        key, layer = megatron_name(name)
        ours[key] = tuple(p.shape) if layer is None else (m.num_layers, *p.shape)
    assert ours.keys() == ref.keys() | factories
    assert {k: v for k, v in ours.items() if k in ref} == ref
    assert "mtp.layers.1.transformer_layer.self_attention.linear_qkv.layer_norm_weight" in ours


def test_gpt_with_moe_and_an_mtp_layer_equals_megatron_core(megatron_cpu, monkeypatch):
    """DeepSeek-V3's shape: a dense first layer, an MoE last layer (shared expert, sigmoid group
    routing with expert bias), so the MTP layer is an MoE layer too (megatron-core builds the
    decoder's last layer spec there): logits, losses, the balancing losses and every gradient."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megafab.model.moe.balancing import LossScale
    from megafab.model.moe.router import routers_of
    from megafab.model.moe.settings import MoESettings
    from megafab.model.transformer import LayerContext
    from tests.helpers.mcore_moe import megatron_losses, set_megatron_loss_scale

    m = tiny_config(style=LLAMA_STYLE, num_layers=2, mtp_num_layers=1, mtp_loss_scaling_factor=FACTOR).model
    settings = MoESettings(**MOE)
    monkeypatch.setattr(tensor_parallel, "vocab_parallel_cross_entropy", exact_cross_entropy)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    moe = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(settings).items()
           if k in fields and k != "moe_grouped_gemm"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
            kv_channels=m.kv_channels, normalization=m.normalization, layernorm_epsilon=m.norm_epsilon,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
            attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float64,
            gradient_accumulation_fusion=False, bias_activation_fusion=False, mtp_num_layers=1,
            mtp_loss_scaling_factor=FACTOR, num_moe_experts=settings.num_experts, **moe)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=m.normalization)
        theirs = McoreGPT(config, spec, vocab_size=m.padded_vocab_size,
                          max_sequence_length=m.max_position_embeddings, parallel_output=False,
                          share_embeddings_and_output_weights=False, position_embedding_type="rope",
                          rotary_percent=m.rotary_percent, rotary_base=m.rotary_base,
                          mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    theirs = theirs.double()
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    megatron_losses()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = GPTModel(m, LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, moe=settings,
                                    moe_loss_scale=LossScale()))
    theirs.rotary_pos_emb.inv_freq = ours.rotary.inv_freq.clone()
    params = dict(ours.named_parameters())
    assert params.keys() == dict(theirs.named_parameters()).keys()
    assert "mtp.layers.0.transformer_layer.mlp.router.weight" in params
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            params[name].copy_(p)
    tokens, labels, mask = batch(m)
    s = tokens.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
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
    assert (ref - loss).abs().max().item() < 1e-12
    assert (ours.mtp.take_logged_losses() - ref_logged).abs().max().item() < 1e-12
    for name, p in theirs.named_parameters():
        assert (p.grad - params[name].grad).abs().max().item() < 1e-12, name
    balancing = megatron_losses()
    logged = {}
    for router in routers_of([ours]):  # the decoder's MoE layer and the MTP layer's
        for name, value in router.logged_losses.items():
            logged[name] = logged.get(name, 0.0) + value.item()
    assert len(routers_of([ours])) == 2 and balancing.keys() == logged.keys()
    for name, value in balancing.items():
        assert abs(value - logged[name]) < 1e-12 * max(1.0, abs(value)), name


def test_per_token_loss_mtp_gradients_equal_megatron_core(megatron_cpu, monkeypatch):
    """--calculate-per-token-loss: megatron-core attaches each depth's masked loss sum (not its mean)
    at the grad scale and divides every gradient by the main loss's tokens at the end; megafab's
    per-token MTP block at weight 1 / tokens (training/mtp.py's mtp_loss_scale) gives those gradients."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    from megafab.model.transformer import LayerContext

    m = tiny_config(style=LLAMA_STYLE, num_layers=2, mtp_num_layers=2, mtp_loss_scaling_factor=FACTOR).model
    monkeypatch.setattr(tensor_parallel, "vocab_parallel_cross_entropy", exact_cross_entropy)
    theirs = megatron_gpt(m, per_token=True)
    ours = GPTModel(m, LayerContext(None, False, torch.float64, torch.device("cpu"), 1234,
                                    calculate_per_token_loss=True))
    theirs.rotary_pos_emb.inv_freq = ours.rotary.inv_freq.clone()
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            params[name].copy_(p)
    tokens, labels, mask = batch(m)
    s = tokens.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    MTPLossLoggingHelper.tracker.clear()
    MTPLossLoggingHelper.tracker["values"] = torch.zeros(2, dtype=torch.float64)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
    per_token = theirs(tokens, torch.arange(s).expand_as(tokens), causal, labels=labels, loss_mask=mask)
    (per_token * mask).sum().backward()
    MTPLossLoggingHelper.tracker.clear()
    ours.mtp.loss_scale.set(1.0 / mask.sum().item())
    masked_mean_loss(ours(tokens, labels=labels, loss_mask=mask), mask).backward()
    for name, p in theirs.named_parameters():
        assert (p.grad / mask.sum() - params[name].grad).abs().max().item() < 1e-12, name


def test_moe_mtp_torch_dist_keys_are_megatron_cores(megatron_cpu):
    """An MoE MTP layer's tensors (routed experts grouped [E, out, in], not stacked; shared experts,
    router, expert bias) and its `_extra_state` objects (per routed expert too) as megatron-core's."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megafab.checkpoint.megatron_dist import mtp_expert_extra_state_objects, mtp_extra_state_objects
    from megafab.checkpoint.megatron_keys import megatron_name
    from megafab.model.moe.settings import MoESettings
    from megafab.model.transformer import LayerContext
    from megafab.param_names import experts_name

    m = tiny_config(style=LLAMA_STYLE, num_layers=2, mtp_num_layers=1).model
    settings = MoESettings(**MOE)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    moe = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(settings).items()
           if k in fields and k != "moe_grouped_gemm"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=2, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
            kv_channels=m.kv_channels, normalization=m.normalization, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
            gradient_accumulation_fusion=False, bias_activation_fusion=False, mtp_num_layers=1,
            num_moe_experts=settings.num_experts, **moe)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=m.normalization)
        theirs = McoreGPT(config, spec, vocab_size=m.padded_vocab_size,
                          max_sequence_length=m.max_position_embeddings,
                          share_embeddings_and_output_weights=False, position_embedding_type="rope",
                          mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    sharded = [v for v in theirs.sharded_state_dict().values() if v.key.startswith("mtp.")]
    ref = {v.key: tuple(v.global_shape) for v in sharded if isinstance(v, ShardedTensor)}
    factories = {v.key for v in sharded if isinstance(v, ShardedTensorFactory)}
    objects = {v.unique_key for v in sharded if isinstance(v, ShardedObject)}
    ours = GPTModel(m, LayerContext(None, False, torch.float32, torch.device("cpu"), 1, moe=settings))
    keys = {}
    for name, p in ours.named_parameters():
        if name.startswith("mtp."):
            keys[megatron_name(experts_name(name))[0]] = (settings.num_experts, *p.shape) \
                if ".local_experts." in name else tuple(p.shape)
    keys[megatron_name("mtp.layers.0.transformer_layer.mlp.router.expert_bias")[0]] = (settings.num_experts,)
    assert keys.keys() == ref.keys() | factories
    assert {k: v for k, v in keys.items() if k in ref} == ref
    written = set(mtp_extra_state_objects(m, settings)) | set(
        mtp_expert_extra_state_objects(m, settings, range(settings.num_experts)))
    assert any("experts.experts.linear_fc1._extra_state/shard_3_4" in k for k in written)
    assert written == objects
