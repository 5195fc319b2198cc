"""The planner's MoE terms against Megatron-LM core_v0.16.1's own formulas (ported below as
independent oracles, from megatron/training/theoretical_memory_usage.py and training.py), and
against the shapes of megafab's MoE modules."""

import pytest

from megafab.arguments import config_from_args
from megafab.plan.moe import bound_rows, expected_rows, moe_mlp_params
from megafab.training.flops import flops_per_iteration
from megafab.training.planner import model_params

MIXTRAL = """--disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
    --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --normalization RMSNorm
    --position-embedding-type rope --swiglu --untie-embeddings-and-output-weights --group-query-attention
    --num-query-groups 8 --vocab-size 32000 --micro-batch-size 1 --global-batch-size 256 --bf16
    --dry-run""".split()
SMALL = """--num-layers 4 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --seq-length 32
    --vocab-size 250 --micro-batch-size 2 --global-batch-size 8 --disable-bias-linear
    --position-embedding-type rope --dry-run""".split()  # Megatron counts neither biases nor positions


def moe_flags(**moe) -> list[str]:
    """Megatron's MoE flags for MoESettings keywords."""
    out = []
    for name, value in moe.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        else:
            out += [flag, str(list(value)) if isinstance(value, tuple) else str(value)]
    return out


def with_moe(flags, world_size=1, **moe):
    """The finalized config of the flags plus the MoE settings' flags."""
    cfg = config_from_args(flags + moe_flags(**moe), world_size=world_size)
    assert all(getattr(cfg.moe, name) == value for name, value in moe.items()), cfg.moe
    return cfg


def _megatron_layer_pattern(m, moe):
    freq = moe.moe_layer_freq
    return [1 if i % freq == 0 else 0 for i in range(m.num_layers)] if isinstance(freq, int) else list(freq)


def megatron_parameter_count(m, moe) -> float:
    """compute_weight_and_optimizer_memory's num_total_parameters (no MTP, no MLA)."""
    gated = 3 / 2 if m.swiglu else 1
    norm = 1 if m.normalization == "RMSNorm" else 2
    pattern = _megatron_layer_pattern(m, moe)
    moe_layers = sum(pattern)
    dense_layers = m.num_layers - moe_layers
    shared = moe.moe_shared_expert_intermediate_size or 0
    ratio = m.kv_channels * m.num_attention_heads / m.hidden_size
    attn = 2 * m.hidden_size * m.hidden_size * ((1 + m.num_query_groups / m.num_attention_heads) * ratio)
    dense = 2 * m.hidden_size * (m.ffn_hidden_size * gated + norm) + attn
    moe_ffn = moe.moe_ffn_hidden_size or m.ffn_hidden_size
    moe_layer = 2 * m.hidden_size * (moe_ffn * moe.num_experts * gated + shared * gated + norm) + attn
    embedding = m.hidden_size * m.padded_vocab_size * (2 if m.untie_embeddings_and_output_weights else 1)
    return dense * dense_layers + moe_layer * moe_layers + norm * m.hidden_size + embedding


def megatron_flops(m, moe, batch_size) -> float:
    """num_floating_point_operations (transformer_flops, GQA/MHA, no MTP) at core_v0.16.1."""
    pattern = _megatron_layer_pattern(m, moe)
    moe_layers = sum(pattern)
    dense_layers = m.num_layers - moe_layers
    moe_ffn = moe.moe_ffn_hidden_size or m.ffn_hidden_size
    shared = moe.moe_shared_expert_intermediate_size or 0
    ffn_factor = 3 if m.swiglu else 2
    q = m.kv_channels * m.num_attention_heads
    kv = m.kv_channels * m.num_query_groups
    attn = 3 * 2 * (m.hidden_size * (q + 2 * kv) + q * m.seq_length / 2 * 2 + q * m.hidden_size)
    return batch_size * m.seq_length * (
        3 * 2 * m.hidden_size * (m.ffn_hidden_size * ffn_factor * dense_layers
                                 + moe_ffn * moe.moe_router_topk * ffn_factor * moe_layers
                                 + shared * ffn_factor * moe_layers)
        + attn * m.num_layers + 3 * 2 * m.hidden_size * m.padded_vocab_size)


def megafab_attention_surplus(m, batch_size) -> float:
    """megafab counts the full s x s attention matrices, Megatron 0.16 the causal half: the
    difference is 0.16's core-attention term, 3 * 2 * a d s per token and layer."""
    return batch_size * m.seq_length * 6 * m.kv_channels * m.num_attention_heads * m.seq_length * m.num_layers


def test_mixtral_8x7b_total_and_active_parameters_match_megatron():
    cfg = with_moe(MIXTRAL, num_experts=8, moe_router_topk=2)
    total, active = model_params(cfg)
    reference = megatron_parameter_count(cfg.model, cfg.moe)
    assert round(reference / 1e9, 2) == 46.70
    assert total == pytest.approx(reference, rel=5e-3)
    assert total - reference == 32 * 8 * 4096  # exactly Megatron's count plus the routers (E h per layer)
    assert active / 1e9 == pytest.approx(12.88, abs=0.01)


@pytest.mark.parametrize("moe", [
    dict(num_experts=8, moe_router_topk=2),
    dict(num_experts=4, moe_router_topk=1, moe_router_pre_softmax=True, moe_ffn_hidden_size=48,
         moe_shared_expert_intermediate_size=80, moe_layer_freq=(0, 1, 1, 0)),
    dict(num_experts=16, moe_router_topk=4, moe_layer_freq=2, moe_shared_expert_intermediate_size=32),
])
@pytest.mark.parametrize("swiglu", [False, True])
def test_flops_equal_megatron_formula_for_moe_configs(moe, swiglu):
    cfg = with_moe(SMALL + (["--swiglu"] if swiglu else []), **moe)
    batch = 8
    expected = megatron_flops(cfg.model, cfg.moe, batch) + megafab_attention_surplus(cfg.model, batch)
    assert flops_per_iteration(cfg, batch) == pytest.approx(expected, rel=1e-12)
    total = megatron_parameter_count(cfg.model, cfg.moe)
    router = cfg.moe.num_experts * cfg.model.hidden_size * sum(_megatron_layer_pattern(cfg.model, cfg.moe))
    assert model_params(cfg)[0] - router == pytest.approx(total, rel=1e-12)


def test_moe_flops_count_topk_experts_not_all():
    two = flops_per_iteration(with_moe(SMALL, num_experts=8, moe_router_topk=2), 8)
    four = flops_per_iteration(with_moe(SMALL, num_experts=8, moe_router_topk=4), 8)
    cfg = with_moe(SMALL, num_experts=8, moe_router_topk=2)
    m = cfg.model
    per_expert = 3 * 2 * 2 * m.hidden_size * m.ffn_hidden_size * m.seq_length * 8  # fwd+bwd, fc1+fc2
    assert four - two == pytest.approx(2 * m.num_layers * per_expert)


@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (4, 1), (2, 2), (8, 2)])
def test_expert_params_per_rank_are_total_over_ep_and_etp(ep, etp):
    cfg = with_moe(SMALL + ["--swiglu"], num_experts=8, moe_router_topk=2,
                   moe_shared_expert_intermediate_size=32)
    whole = moe_mlp_params(cfg.model, cfg.moe)
    rank = moe_mlp_params(cfg.model, cfg.moe, tp=2, etp=etp, ep=ep)
    assert rank.experts * ep * etp == whole.experts
    assert rank.router == whole.router == 8 * 64  # replicated
    assert rank.shared * 2 == whole.shared  # shared experts are split over TP, not ETP


def test_routed_rows_capacity_and_worst_case():
    cfg = with_moe(SMALL, num_experts=8, moe_router_topk=2)
    tokens = 2 * 32
    assert expected_rows(cfg, cfg.moe) == tokens * 2
    assert bound_rows(cfg, cfg.moe) == tokens * 2  # EP 1: every token's k copies land here
    capped = with_moe(SMALL, num_experts=8, moe_router_topk=2, moe_expert_capacity_factor=1.0,
                      moe_pad_expert_input_to_capacity=True)
    assert bound_rows(capped, capped.moe) == 8 * (tokens * 2 // 8)
