"""The step-time model's backward redoes the forward work of each --recompute-modules module: core_attn
the attention kernel, mlp a dense layer's fc1/fc2 GEMMs, moe an MoE layer's whole MLP (its GEMMs
and token dispatch), shared_experts the shared experts' GEMMs, layernorm and moe_act memory-bound
passes only; the forward is unchanged."""

import pytest

from megafab.arguments import config_from_args
from megafab.plan.layer_time import Pass, layer_passes
from megafab.plan.machines import machine

H100 = machine("h100-sxm-80gb")
MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
         "--max-position-embeddings", "2048", "--vocab-size", "32000", "--bf16", "--swiglu",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--dry-run"]
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--moe-grouped-gemm",
       "--moe-shared-expert-intermediate-size", "1024", "--expert-model-parallel-size", "2",
       "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]


def _passes(moe: bool, modules=()):
    selective = ["--recompute-granularity", "selective", "--recompute-modules", *modules] if modules else []
    cfg = config_from_args(MODEL + (MOE if moe else []) + selective, world_size=2)
    return layer_passes(cfg, H100, moe_layer=moe)


def _extra(moe, module) -> Pass:
    (fwd0, bwd0), (fwd, bwd) = _passes(moe), _passes(moe, [module])
    assert (fwd.gemm, fwd.attention, fwd.memory, fwd.ep) == (fwd0.gemm, fwd0.attention, fwd0.memory, fwd0.ep)
    return Pass(bwd.gemm - bwd0.gemm, bwd.attention - bwd0.attention, bwd.memory - bwd0.memory,
                ep=bwd.ep - bwd0.ep)


def test_dense_modules_add_their_forward_to_backward():
    fwd, _ = _passes(False)
    attention = _extra(False, "core_attn")
    assert attention.attention == pytest.approx(fwd.attention) and attention.gemm == 0
    mlp = _extra(False, "mlp")
    assert 0 < mlp.gemm < fwd.gemm and mlp.attention == 0 and mlp.memory > 0
    norms = _extra(False, "layernorm")
    assert norms.gemm == norms.attention == 0 and norms.memory > 0


def test_moe_modules_add_their_forward_to_backward():
    fwd, _ = _passes(True)
    whole = _extra(True, "moe")
    shared = _extra(True, "shared_experts")
    act = _extra(True, "moe_act")
    assert 0 < shared.gemm < whole.gemm < fwd.gemm
    assert whole.ep == pytest.approx(fwd.ep) and shared.ep == act.ep == 0  # the dispatch runs again
    assert act.gemm == 0 and 0 < act.memory < whole.memory
    assert _extra(True, "mlp").gemm == 0  # mlp is the dense MLP's: none in an MoE layer
