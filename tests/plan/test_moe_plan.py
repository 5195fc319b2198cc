"""The planner's MoE terms against Megatron-LM core_v0.16.1's own formulas (ported below as
independent oracles, from megatron/training/theoretical_memory_usage.py and training.py), and
against the shapes of megafab's MoE modules."""

import pytest

from megafab.arguments import config_from_args
from megafab.plan.flops import flops_per_iteration
from megafab.plan.machines import machine
from megafab.plan.moe import bound_rows, expected_rows, expert_data_parallel_size, moe_mlp_params
from megafab.plan.planner import model_params, plan
from megafab.plan.search import search
from megafab.plan.step_time import predict

MIXTRAL = """--disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
    --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --normalization RMSNorm
    --position-embedding-type rope --swiglu --untie-embeddings-and-output-weights --group-query-attention
    --num-query-groups 8 --vocab-size 32000 --micro-batch-size 1 --global-batch-size 256 --bf16
    --dry-run""".split()
SMALL = """--num-layers 4 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --seq-length 32
    --vocab-size 250 --micro-batch-size 2 --global-batch-size 16 --disable-bias-linear
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


def mixtral_script_flags(tmp_path) -> list[str]:
    """Megatron's Mixtral 8x7B script (tests/test_megatron_launch_scripts.py), its 32000-token Llama-2
    tokenizer as a NullTokenizer of that size (Megatron's NullTokenizer adds the end-of-document
    token) and mock data: the parameter count needs the real vocabulary."""
    from tests.helpers.megatron_scripts import MIXTRAL_8X7B

    text = " ".join(MIXTRAL_8X7B).replace("--tokenizer-type Llama2Tokenizer --tokenizer-model {spm}",
                                          "--tokenizer-type NullTokenizer --vocab-size 31999")
    text = text.replace("--data-path {data}", "--mock-data")
    return text.format(ckpt=tmp_path / "ckpt", tb=tmp_path / "tb").split()


def test_mixtral_script_dry_run_at_world_32_prints_megatrons_parameter_count(tmp_path, monkeypatch, capsys):
    from megafab.cli.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.delenv("RANK", raising=False)
    assert main(mixtral_script_flags(tmp_path) + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  parameters:"))
    total = float(line.split()[1].rstrip("B"))
    assert total == pytest.approx(46.70, rel=5e-3), line  # Megatron: 46.70B
    assert "12.88B active (2 of 8 routed experts per MoE layer)" in line
    assert "EP 8 x ETP 1 x expert-DP 1" in line
    assert "megafab plan: world 32 = TP 1 x PP 4 x DP 8" in out


def test_estimate_prints_active_and_total_parameters(capsys):
    from megafab.cli.estimate import main

    flags = [f for f in SMALL if f != "--dry-run"] + moe_flags(num_experts=8, moe_router_topk=2)
    layout = ["--num-gpus", "8", "--expert-model-parallel-size", "4", "--gpu", "h100-sxm-80gb"]
    assert main(flags + layout) == 0
    out = capsys.readouterr().out
    cfg = with_moe(SMALL, num_experts=8, moe_router_topk=2)
    total, active = model_params(cfg)
    assert f"parameters: {total / 1e6:.2f}M total, {active / 1e6:.2f}M active" in out
    assert active < total
    assert "ep_comm" in out  # the EP all-to-all is part of the predicted step


@pytest.mark.parametrize("sharding", ["--use-distributed-optimizer", "--use-torch-fsdp2"])
def test_expert_state_per_rank_is_total_over_ep_sharded_over_expert_dp(sharding):
    world = 8
    totals = set()
    for ep in (1, 2, 4, 8):
        cfg = with_moe(SMALL + [sharding, "--bf16", "--expert-model-parallel-size", str(ep)],
                       world_size=world, num_experts=8, moe_router_topk=2)
        (stage,) = plan(cfg)
        totals.add(stage.expert_params * ep)
        dense, expert, edp = stage.params - stage.expert_params, stage.expert_params, world // ep
        assert edp == expert_data_parallel_size(cfg)
        if sharding == "--use-torch-fsdp2":  # fp32 shards are the masters: 4 + 4 + 8 bytes per element
            assert stage.weights_bytes == int(4 * dense / world) + int(4 * expert / edp)
            assert stage.optimizer_bytes == int(8 * dense / world) + int(8 * expert / edp)
        else:  # bf16 weights, fp32 grads everywhere; master + Adam sharded, experts over expert-DP
            assert stage.weights_bytes == 2 * stage.params
            assert stage.optimizer_bytes == int(12 * dense / world) + int(12 * expert / edp)
    assert len(totals) == 1  # per-rank expert params x EP: every expert, once


def test_step_time_counts_the_ep_all_to_all_and_the_expert_dp_reduction():
    """World 8, no overlap: the all-to-all only with EP > 1; the experts' gradients reduce over
    expert-DP, which EP 8 leaves one rank wide (nothing to reduce), EP 2 four."""
    parts = {}
    for ep in (1, 2, 8):
        cfg = with_moe([f for f in SMALL if f != "--dry-run"] + ["--expert-model-parallel-size", str(ep),
                                                                "--dry-run"],
                       world_size=8, num_experts=8, moe_router_topk=2, moe_token_dispatcher_type="alltoall")
        parts[ep] = predict(cfg, machine("h100-sxm-80gb"), plan(cfg)).breakdown
    assert parts[1]["ep_comm"] == 0 and parts[2]["ep_comm"] > 0 and parts[8]["ep_comm"] > 0
    assert parts[1]["dp_comm"] > parts[2]["dp_comm"] > parts[8]["dp_comm"] > 0


def test_search_enumerates_expert_parallel_layouts_the_rules_accept():
    flags = [f for f in SMALL if f != "--dry-run"] + moe_flags(num_experts=4, moe_router_topk=2)
    result = search(flags, 8, machine("h100-sxm-80gb"), top=20, micro_batch_sizes=(1, 2))
    eps = {c.ep for c in result.ranked}
    assert eps - {1} and eps <= {1, 2, 4}  # EP > 1 is searched; EP divides the 4 experts
    for cand in result.ranked:
        assert 8 % (cand.etp * cand.ep * cand.pp) == 0
        parsed = config_from_args(cand.flags + ["--dry-run"], world_size=8).parallel
        assert (parsed.expert_model_parallel_size, parsed.expert_tensor_parallel_size) == (cand.ep, cand.etp)


@pytest.mark.parametrize("swiglu,bias,shared,gate,grouped", [
    (False, False, None, False, False), (True, True, None, False, True), (True, False, 24, True, False)])
def test_moe_mlp_params_are_what_megafabs_moe_layer_builds(swiglu, bias, shared, gate, grouped):
    import torch

    from megafab.model.activations import MLPActivation
    from megafab.model.moe.layer import MoELayer
    from megafab.model.transformer import LayerContext

    flags = [f for f in SMALL if f != "--disable-bias-linear"] + ["--swiglu"] * swiglu + \
        ["--disable-bias-linear"] * (not bias) + ["--moe-grouped-gemm"] * grouped + \
        ["--moe-shared-expert-gate"] * gate
    extra = {"moe_shared_expert_intermediate_size": shared} if shared else {}
    cfg = with_moe(flags, num_experts=4, moe_router_topk=2, **extra)
    layer = MoELayer(cfg.moe, cfg.model, LayerContext(None, False, torch.float32, torch.device("cpu"), 5),
                     "decoder.layers.0.mlp.", activation=MLPActivation.from_model_config(cfg.model))
    counted = moe_mlp_params(cfg.model, cfg.moe)
    assert counted.total == sum(p.numel() for p in layer.parameters())
    assert counted.router == sum(p.numel() for p in layer.router.parameters())
    assert counted.experts == sum(p.numel() for p in layer.experts.parameters()) \
        == sum(p.numel() for p in layer.parameters() if getattr(p, "is_expert", False))


@pytest.mark.parametrize("swiglu,bf16,shared", [(False, False, None), (False, True, 48), (True, True, None),
                                                (True, False, 48)])
def test_moe_mlp_activation_bytes_equal_what_autograd_saves(swiglu, bf16, shared):
    """One rank: the routed rows are exactly N k, the bound and the balanced count alike."""
    import torch

    from megafab.model.activations import MLPActivation
    from megafab.model.moe.layer import MoELayer
    from megafab.model.transformer import LayerContext
    from megafab.optim.memory import SavedActivations
    from megafab.plan.moe import moe_mlp_activation_bytes

    extra = {"moe_shared_expert_intermediate_size": shared} if shared else {}
    cfg = with_moe(SMALL + ["--swiglu"] * swiglu + ["--bf16"] * bf16, num_experts=4, moe_router_topk=2,
                   **extra)
    dtype, e = (torch.bfloat16, 2) if bf16 else (torch.float32, 4)
    layer = MoELayer(cfg.moe, cfg.model, LayerContext(None, False, dtype, torch.device("cpu"), 5),
                     "decoder.layers.0.mlp.", activation=MLPActivation.from_model_config(cfg.model))
    m = cfg.model
    x = torch.randn(m.seq_length, cfg.training.micro_batch_size, m.hidden_size, dtype=dtype,
                    requires_grad=True)
    with SavedActivations(layer.parameters()) as saved:
        layer(x)
    assert bound_rows(cfg, cfg.moe) == expected_rows(cfg, cfg.moe) == x.numel() // m.hidden_size * 2
    input_bytes = e * x.numel()  # the normed input: the dense layer's formula counts it
    assert saved.bytes == moe_mlp_activation_bytes(cfg, cfg.moe, expected_rows(cfg, cfg.moe), e) + input_bytes


def test_moe_routing_balanced_plans_the_expected_rows(capsys):
    """Megatron's Mixtral layout (TP 1, PP 4, EP 8, dropless): its first stage does not fit an 80 GB
    H100 at the routed rows' bound (every token of the EP group to one rank's expert), and fits at
    balanced routing."""
    from megafab.cli.estimate import main

    flags = [f for f in MIXTRAL if f != "--dry-run"] + moe_flags(num_experts=8, moe_router_topk=2) + [
        "--moe-token-dispatcher-type", "alltoall", "--pipeline-model-parallel-size", "4",
        "--expert-model-parallel-size", "8", "--use-distributed-optimizer", "--num-gpus", "32",
        "--gpu-memory-gb", "80"]
    stage0 = {}
    for routing in ("bound", "balanced"):
        assert main(flags + ["--moe-routing", routing]) == 0
        stage0[routing] = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  stage 0:"))
    assert "DOES NOT FIT" in stage0["bound"] and "balanced routing: total" in stage0["bound"]
    assert stage0["balanced"].endswith("fits") and "routed rows balanced" in stage0["balanced"]
