"""--transformer-impl transformer_engine with MoE, MLA, --qk-layernorm, MTP and selective recompute:
the config rules accept them, and through tests/helpers/fake_te.py (TE's documented constructor
keywords, plain-torch math) megafab's layer around TE's modules has megatron-core's TE-spec
parameter names (norms fused into linear_qkv, linear_fc1 and the MLA up projections), the local
model's weights and parameter count, and its outputs and gradients (float64)."""

from __future__ import annotations

import pytest
import torch

from megafab.model.gpt import GPTModel
from megafab.model.moe.balancing import LossScale
from megafab.model.moe.settings import MoESettings
from megafab.model.te import te_available
from megafab.model.te_wrap import TEWrappedTransformerLayer
from megafab.model.transformer import LayerContext
from tests.helpers import fake_te
from tests.helpers.fake_te import te_name
from tests.helpers.mcore_mla import MLA_STYLE
from tests.helpers.mcore_mtp import MOE
from tests.helpers.tiny import LLAMA_STYLE, batch, tiny_config

TE = dict(transformer_impl="transformer_engine", bf16=True)


def deepseek_models(**overrides):
    m_local = tiny_config(style=MLA_STYLE, num_layers=2, mtp_num_layers=1, **overrides).model
    m_te = tiny_config(style=MLA_STYLE, num_layers=2, mtp_num_layers=1, **TE, **overrides).model

    def build(m):
        return GPTModel(m, LayerContext(None, False, torch.float64, torch.device("cpu"), 1234,
                                        moe=MoESettings(**MOE), moe_loss_scale=LossScale()))
    return m_local, build(m_local), build(m_te)


def test_rules_accept_te_with_moe_mla_qk_norm_mtp_recompute_and_fsdp():
    cfg = tiny_config(style=MLA_STYLE, num_layers=4, mtp_num_layers=1, num_experts=4, moe_router_topk=2,
                      moe_layer_freq=[0, 1, 1, 1], recompute_granularity="selective",
                      recompute_modules=["mlp", "moe", "mla_up_proj", "layernorm"], **TE)
    assert cfg.model.transformer_impl == "transformer_engine" and cfg.moe.num_experts == 4
    for fsdp in ({"use_torch_fsdp2": True}, {"use_megatron_fsdp": True}):  # FSDP2 around TE's modules
        assert tiny_config(dp=2, **fsdp, **TE).parallel.fully_sharded
    with pytest.raises(ValueError, match="--apply-residual-connection-post-layernorm implemented for"):
        tiny_config(apply_residual_connection_post_layernorm=True, **TE)


def test_te_deepseek_shape_has_te_names_local_weights_and_outputs(monkeypatch):
    record = fake_te.install(monkeypatch)
    m, local, te_model = deepseek_models()
    assert isinstance(te_model.mtp.layers["0"].transformer_layer, TEWrappedTransformerLayer)
    moe_layers = {"decoder.layers.1.", "mtp.layers.0.transformer_layer."}
    local_state, te_state = local.state_dict(), te_model.state_dict()
    assert {te_name(n, moe_layers) for n in local_state} == set(te_state)
    for name, value in local_state.items():
        assert torch.equal(te_state[te_name(name, moe_layers)], value), name
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te_state
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in te_state  # MoE: TENorm, separate
    assert "decoder.layers.0.input_layernorm.weight" in te_state  # MLA: TENorm, separate
    assert "decoder.layers.0.self_attention.q_layernorm.weight" not in te_state
    assert sum(p.numel() for p in te_model.parameters()) == sum(p.numel() for p in local.parameters())
    kinds = {(kind, args, kw.get("parallel_mode")) for kind, args, kw in record}
    h, q, kv = m.hidden_size, m.q_lora_rank, m.kv_lora_rank
    heads = m.num_attention_heads
    assert ("Linear", (h, q), None) in kinds and ("Linear", (h, kv + m.qk_pos_emb_head_dim), None) in kinds
    assert ("LayerNormLinear", (q, heads * (m.qk_head_dim + m.qk_pos_emb_head_dim)), "column") in kinds
    assert ("LayerNormLinear", (kv, heads * (m.qk_head_dim + m.v_head_dim)), "column") in kinds
    channels = (m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim)
    assert ("DotProductAttention", (heads, channels), None) in kinds
    assert ("Linear", (h, 2 * MOE["moe_shared_expert_intermediate_size"]), "column") in kinds
    tokens, labels, mask = batch(m)
    losses = []
    for model in (local, te_model):
        model.mtp.loss_scale.set(1.0)
        model.ctx.moe_loss_scale.set(1.0)
        loss = model(tokens, labels=labels, loss_mask=mask)
        (loss * mask).sum().backward()
        losses.append(loss)
    assert (losses[0] - losses[1]).abs().max() < 1e-10
    te_params = dict(te_model.named_parameters())
    for name, p in local.named_parameters():
        assert (p.grad - te_params[te_name(name, moe_layers)].grad).abs().max() < 1e-10, name


@pytest.mark.parametrize("modules", [["core_attn", "mla_up_proj", "layernorm"], ["moe", "shared_experts"]])
def test_te_layers_under_selective_recompute_equal_no_recompute(monkeypatch, modules):
    fake_te.install(monkeypatch)
    m, _, plain = deepseek_models()
    _, _, recomputed = deepseek_models(recompute_granularity="selective", recompute_modules=modules)
    tokens, labels, mask = batch(m)
    grads = []
    for model in (plain, recomputed):
        model.mtp.loss_scale.set(1.0)
        model.ctx.moe_loss_scale.set(1.0)
        (model(tokens, labels=labels, loss_mask=mask) * mask).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert (grad - grads[1][name]).abs().max() < 1e-10, name


def test_te_standard_attention_with_qk_layernorm(monkeypatch):
    fake_te.install(monkeypatch)
    m_local = tiny_config(style=LLAMA_STYLE, qk_layernorm=True).model
    m_te = tiny_config(style=LLAMA_STYLE, qk_layernorm=True, **TE).model
    ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), 1234)
    local, te_model = GPTModel(m_local, ctx), GPTModel(m_te, ctx)
    te_state = te_model.state_dict()
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te_state
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in te_state  # TENorm over each head
    assert "decoder.layers.0.input_layernorm.weight" not in te_state
    assert len(te_state) == len(local.state_dict())
    tokens = torch.randint(0, m_local.vocab_size, (2, m_local.seq_length))
    assert (local(tokens) - te_model(tokens)).abs().max() < 1e-10


@pytest.mark.skipif(not (te_available() and torch.cuda.is_available()),
                    reason="needs transformer_engine and a CUDA GPU (neither is on the CPU CI machine)")
def test_te_wrapped_deepseek_shape_equals_local_on_gpu():
    """Real TE (benchmarks/gpu_device_check.sh): MLA + MoE + shared expert + MTP around TE's modules
    holds the local model's weights under TE names and gives its outputs (fp32, TE's kernels)."""
    m_local = tiny_config(style=MLA_STYLE, num_layers=2, mtp_num_layers=1).model
    m_te = tiny_config(style=MLA_STYLE, num_layers=2, mtp_num_layers=1, **TE).model

    def build(m):
        return GPTModel(m, LayerContext(None, False, torch.float32, torch.device("cuda"), 1234,
                                        moe=MoESettings(**MOE), moe_loss_scale=LossScale()))
    local, te_model = build(m_local), build(m_te)
    moe_layers = {"decoder.layers.1.", "mtp.layers.0.transformer_layer."}
    te_state = te_model.state_dict()
    for name, value in local.state_dict().items():
        assert torch.equal(te_state[te_name(name, moe_layers)], value), name
    tokens, labels, mask = (t.cuda() for t in batch(m_local))
    losses = []
    for model in (local, te_model):
        model.mtp.loss_scale.set(1.0)
        model.ctx.moe_loss_scale.set(1.0)
        losses.append(model(tokens, labels=labels, loss_mask=mask).float())
    assert (losses[0] - losses[1]).abs().max().item() < 1e-3 * losses[0].abs().max().item()


def test_moe_permute_fusion_runs_tes_fused_permutation(monkeypatch):
    """--moe-permute-fusion with Transformer Engine's layers: accepted, and the dispatcher permutes
    through TE's moe_permute_with_probs / moe_unpermute (the stand-in's), same outputs and grads
    (local layers accept it too and permute unfused: no effect, announced by the parser)."""
    record = fake_te.install(monkeypatch)
    assert tiny_config(num_experts=4, moe_router_topk=2, moe_permute_fusion=True).moe.moe_permute_fusion
    cfg = tiny_config(num_experts=4, moe_router_topk=2, moe_permute_fusion=True, **TE)
    assert cfg.moe.moe_permute_fusion
    m, local, te_model = deepseek_models()
    fused = GPTModel(tiny_config(style=MLA_STYLE, num_layers=2, mtp_num_layers=1, **TE).model,
                     LayerContext(None, False, torch.float64, torch.device("cpu"), 1234,
                                  moe=MoESettings(**MOE, moe_permute_fusion=True),
                                  moe_loss_scale=LossScale()))
    tokens, labels, mask = batch(m)
    losses = []
    for model in (te_model, fused):
        model.mtp.loss_scale.set(1.0)
        model.ctx.moe_loss_scale.set(1.0)
        before = sum(kind == "moe_permute" for kind, _, _ in record)
        loss = model(tokens, labels=labels, loss_mask=mask)
        (loss * mask).sum().backward()
        losses.append((loss, sum(kind == "moe_permute" for kind, _, _ in record) - before))
    assert losses[0][1] == 0 and losses[1][1] == 2  # the MoE decoder layer and the MTP layer
    assert (losses[0][0] - losses[1][0]).abs().max() < 1e-12
    fused_params = dict(fused.named_parameters())
    for name, p in te_model.named_parameters():
        assert (p.grad - fused_params[name].grad).abs().max() < 1e-12, name


def test_te_with_sliding_window_and_sinks_keeps_megafabs_core_attention(monkeypatch):
    """--window-size / --softmax-type with TE: the wrapped layer (TE's linears) keeps megafab's
    core attention and its softmax_offset (megatron-core's TE-spec name too): the local model's
    parameters, outputs and gradients."""
    fake_te.install(monkeypatch)
    style = dict(LLAMA_STYLE, window_size=(3, 0), window_attn_skip_freq=2, softmax_type="learnable")
    m_local, m_te = tiny_config(style=style).model, tiny_config(style=style, **TE).model
    ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), 1234)
    local, te_model = GPTModel(m_local, ctx), GPTModel(m_te, ctx)
    assert isinstance(te_model.decoder.layers["0"], TEWrappedTransformerLayer)
    te_state = te_model.state_dict()
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te_state
    assert torch.equal(te_state["decoder.layers.2.self_attention.core_attention.softmax_offset"],
                       local.state_dict()["decoder.layers.2.self_attention.core_attention.softmax_offset"])
    tokens, labels, mask = batch(m_local)
    grads = []
    for model in (local, te_model):
        (model(tokens, labels=labels) * mask).sum().backward()
        grads.append(model.decoder.layers["0"].self_attention.core_attention.softmax_offset.grad)
    assert (grads[0] - grads[1]).abs().max() < 1e-10 and grads[0].abs().max() > 0
    with torch.no_grad():
        assert (local(tokens) - te_model(tokens)).abs().max() < 1e-10
