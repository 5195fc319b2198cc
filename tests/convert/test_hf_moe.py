"""HF Mixtral / Qwen3-MoE <-> megafab at the state-dict level: the configs map to cfg.moe (router
semantics exactly: Mixtral's softmax-top-k-renormalize = megatron-core's top-k-then-softmax,
Qwen3-MoE's norm_topk_prob false = --moe-router-pre-softmax), the weights round-trip bit for bit
through export (transformers reloads them), and megafab's MoELayer built from an import computes
transformers' MoE block within 1e-5 (float32; HF routes in fp32)."""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from megafab.convert import export_hf, import_hf  # noqa: E402
from megafab.convert.state_dict import ConversionError, module_state_dict  # noqa: E402
from megafab.model.activations import MLPActivation  # noqa: E402
from megafab.model.moe.layer import MoELayer  # noqa: E402
from megafab.model.transformer import LayerContext  # noqa: E402
from tests.helpers.hf_moe_tiny import EXPERTS, TOPK, hf_mixtral, hf_qwen3_moe  # noqa: E402


def _imported(model, tmp_path):
    model.save_pretrained(tmp_path / "hf")
    return import_hf(str(tmp_path / "hf"))


def test_router_semantics_are_the_same_function():
    logits = torch.randn(64, 8, dtype=torch.float64)
    probs = logits.softmax(-1)
    top, idx = probs.topk(2, dim=-1)
    hf_mixtral_probs = top / top.sum(-1, keepdim=True)  # HF: softmax, top-k, renormalize
    top_logits, idx2 = logits.topk(2, dim=-1)  # megatron-core default: top-k, softmax over k
    assert torch.equal(idx, idx2)
    torch.testing.assert_close(top_logits.softmax(-1), hf_mixtral_probs, rtol=0, atol=1e-15)
    # and norm_topk_prob false is not that function: pre-softmax keeps the unrenormalized values
    assert (top.sum(-1) < 1 - 1e-3).all()


def test_mixtral_config_maps_to_megatron_flags(tmp_path):
    sd, cfg = _imported(hf_mixtral(), tmp_path)
    moe = cfg.moe
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (EXPERTS, TOPK, 24)
    router = (moe.moe_router_score_function, moe.moe_router_pre_softmax, moe.moe_layer_freq)
    assert router == ("softmax", False, 1)
    assert moe.moe_aux_loss_coeff == pytest.approx(0.01) and moe.moe_shared_expert_intermediate_size is None
    assert sd["decoder.layers.1.mlp.experts.linear_fc1.weight"].shape == (EXPERTS, 48, 32)
    assert sd["decoder.layers.1.mlp.experts.linear_fc2.weight"].shape == (EXPERTS, 32, 24)
    assert sd["decoder.layers.1.mlp.router.weight"].shape == (EXPERTS, 32)
    assert not any("mlp.linear_fc" in k for k in sd)


def test_qwen3_moe_config_maps_qk_norm_dense_layers_and_router(tmp_path):
    for norm in (False, True):
        sd, cfg = _imported(hf_qwen3_moe(norm_topk_prob=norm), tmp_path / str(norm))
        assert cfg.model.qk_layernorm and cfg.moe.moe_router_pre_softmax is (not norm)
        assert tuple(cfg.moe.moe_layer_freq) == (1, 0)  # layer 1 is in mlp_only_layers
        assert sd["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (8,)
        assert sd["decoder.layers.1.mlp.linear_fc1.weight"].shape == (80, 32)  # dense: intermediate_size 40
        assert sd["decoder.layers.0.mlp.experts.linear_fc1.weight"].shape == (EXPERTS, 48, 32)


@pytest.mark.parametrize("make", [hf_mixtral, lambda: hf_qwen3_moe(norm_topk_prob=True),
                                  lambda: hf_qwen3_moe(norm_topk_prob=False)],
                         ids=["mixtral", "qwen3-renorm", "qwen3-pre-softmax"])
def test_export_round_trips_every_weight_and_transformers_loads_it(make, tmp_path):
    from transformers import AutoModelForCausalLM

    model = make()
    sd, cfg = _imported(model, tmp_path)
    arch = export_hf(sd, cfg, str(tmp_path / "out"))
    assert arch == model.config.model_type
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ours, theirs = back.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), k
    for field in ("num_experts_per_tok", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step"):
        assert getattr(back.config, field, None) == getattr(model.config, field, None), field
    tokens = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, model(tokens).logits, rtol=0, atol=0)


def _megafab_moe_layer(sd, cfg, layer: int, grouped: bool) -> MoELayer:
    moe = dataclasses.replace(cfg.moe, moe_grouped_gemm=grouped)
    ctx = LayerContext(None, False, torch.float32, torch.device("cpu"), 1)
    prefix = f"decoder.layers.{layer}.mlp."
    ours = MoELayer(moe, cfg.model, ctx, prefix, activation=MLPActivation.from_model_config(cfg.model))
    ours.eval()
    names = [prefix + k for k in ours.state_dict()]
    weights = module_state_dict(sd, names)
    ours.load_state_dict({k[len(prefix):]: v for k, v in weights.items()}, strict=True)
    return ours


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
@pytest.mark.parametrize("make", [hf_mixtral, lambda: hf_qwen3_moe(norm_topk_prob=True),
                                  lambda: hf_qwen3_moe(norm_topk_prob=False)],
                         ids=["mixtral", "qwen3-renorm", "qwen3-pre-softmax"])
def test_imported_moe_layer_computes_transformers_moe_block(make, grouped, tmp_path):
    model = make()
    sd, cfg = _imported(model, tmp_path)
    ours = _megafab_moe_layer(sd, cfg, 0, grouped)
    x = torch.randn(3, 7, 32)  # [b, s, h]
    with torch.no_grad():
        theirs = model.model.layers[0].mlp(x)
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        out, _ = ours(x.transpose(0, 1).contiguous())
    torch.testing.assert_close(out.transpose(0, 1), theirs, rtol=0, atol=1e-5)
    # the other router semantics would not match: the mapping is what makes it equal
    flipped = dataclasses.replace(cfg, moe=dataclasses.replace(
        cfg.moe, moe_router_pre_softmax=not cfg.moe.moe_router_pre_softmax))
    with torch.no_grad():
        wrong, _ = _megafab_moe_layer(sd, flipped, 0, grouped)(x.transpose(0, 1).contiguous())
    assert (wrong.transpose(0, 1) - theirs).abs().max() > 1e-3


def test_what_hf_cannot_express_is_refused(tmp_path):
    sd, cfg = _imported(hf_mixtral(), tmp_path)
    sigmoid = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, moe_router_score_function="sigmoid"))
    with pytest.raises(ConversionError, match="sigmoid"):
        export_hf(sd, sigmoid, str(tmp_path / "a"))
    pre = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, moe_router_pre_softmax=True))
    with pytest.raises(ConversionError, match="Qwen3-MoE"):
        export_hf(sd, pre, str(tmp_path / "b"))
    sinkhorn = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe,
                                                                moe_router_load_balancing_type="sinkhorn"))
    with pytest.raises(ConversionError, match="sinkhorn .* HF Mixtral renormalises"):
        export_hf(sd, sinkhorn, str(tmp_path / "c"))
