"""MoESettings' rules: each broken rule gives one line naming the flag, valid settings give none;
and which layers are MoE for an int or a pattern --moe-layer-freq (Megatron's definitions)."""

import pytest

from megafab.model.moe.settings import MoESettings, parse_moe_layer_freq

VALID = dict(num_experts=8, moe_router_topk=2)

BROKEN = {
    "topk above experts": (dict(moe_router_topk=9),
                   "--moe-router-topk 9 must be between 1 and --num-experts 8"),
    "topk zero": (dict(moe_router_topk=0), "--moe-router-topk 0"),
    "experts over EP": (dict(num_experts=6),
                   "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    "flex refused": (dict(moe_token_dispatcher_type="flex"), "flex (DeepEP / HybridEP"),
    "unknown dispatcher": (dict(moe_token_dispatcher_type="alltoall_seq"),
                   "must be one of allgather, alltoall"),
    "score function": (dict(moe_router_score_function="tanh"), "--moe-router-score-function tanh"),
    "router dtype": (dict(moe_router_dtype="bf16"), "--moe-router-dtype bf16 must be one of fp32, fp64"),
    "drop policy": (dict(moe_token_drop_policy="random"), "--moe-token-drop-policy random"),
    "sinkhorn with aux loss": (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.1),
                               "--moe-aux-loss-coeff 0.1 must be 0 with --moe-router-load-balancing-type "
                               "sinkhorn"),
    "coeff count": (dict(moe_router_load_balancing_type=("aux_loss", "seq_aux_loss"), moe_aux_loss_coeff=0.1),
                    "--moe-aux-loss-coeff has 1 value(s) for 2"),
    "group topk without groups": (dict(moe_router_group_topk=2),
                   "--moe-router-group-topk needs --moe-router-num-groups"),
    "groups do not divide": (dict(moe_router_num_groups=3, moe_router_group_topk=1),
                             "--num-experts 8 is not divisible by --moe-router-num-groups 3"),
    "group topk above groups": (dict(moe_router_topk=4, moe_router_num_groups=2, moe_router_group_topk=4),
                                "is larger than"),
    "topk over group topk": (dict(moe_router_topk=3, moe_router_num_groups=4, moe_router_group_topk=2),
                             "--moe-router-topk 3 is not divisible by --moe-router-group-topk 2"),
    "groups too small": (dict(moe_router_topk=6, moe_router_num_groups=4, moe_router_group_topk=2),
                         "needs 3 experts per group, but a group has 2"),
    "top1 softmax": (dict(moe_router_topk=1), "--moe-router-pre-softmax"),
    "bias with softmax": (dict(moe_router_enable_expert_bias=True),
                   "needs --moe-router-score-function sigmoid"),
    "pad without capacity": (dict(moe_pad_expert_input_to_capacity=True),
                   "needs --moe-expert-capacity-factor"),
    "shared size": (dict(moe_shared_expert_intermediate_size=0), "must be positive"),
    "overlap with allgather": (dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True),
                               "--moe-shared-expert-overlap works only with --moe-token-dispatcher-type"),
    "pattern length": (dict(moe_layer_freq=(1, 0, 1)),
                   "--moe-layer-freq pattern has 3 entries for --num-layers 4"),
    "pattern values": (dict(moe_layer_freq=(1, 2, 1, 1)), "entries must be 0 (dense) or 1 (MoE)"),
    "freq zero": (dict(moe_layer_freq=0), "--moe-layer-freq 0 must be at least 1"),
}


@pytest.mark.parametrize("rule", list(BROKEN))
def test_each_rule_has_one_line(rule):
    overrides, text = BROKEN[rule]
    problems = MoESettings(**{**VALID, **overrides}).problems(num_layers=4, expert_parallel_size=4)
    assert len(problems) == 1 and text in problems[0], problems


@pytest.mark.parametrize("settings", [
    VALID,
    dict(num_experts=8, moe_router_topk=1, moe_router_pre_softmax=True),
    dict(num_experts=8, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
         moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32"),
    dict(num_experts=8, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
         moe_token_drop_policy="position", moe_token_dispatcher_type="allgather"),
    dict(num_experts=8, moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True,
         moe_token_dispatcher_type="alltoall", moe_layer_freq=(0, 1, 1, 1)),
    dict(num_experts=8, moe_router_load_balancing_type=("aux_loss", "seq_aux_loss"),
         moe_aux_loss_coeff=(1e-2, 1e-3)),
    dict(num_experts=8, moe_router_topk=1, moe_router_load_balancing_type="sinkhorn"),  # no pre-softmax
    dict(num_experts=8, moe_permute_fusion=True),  # TE's kernel, or no effect with local layers
])
def test_valid_settings_have_no_problems(settings):
    assert MoESettings(**settings).problems(num_layers=4, expert_parallel_size=4) == []


def test_dense_model_refuses_moe_only_flags():
    assert MoESettings().problems() == []
    assert MoESettings(moe_ffn_hidden_size=64).problems() == ["--moe-ffn-hidden-size needs --num-experts"]
    assert not MoESettings().is_moe_layer(0)


def test_moe_layer_freq():
    every_other = MoESettings(num_experts=4, moe_layer_freq=2)
    assert [every_other.is_moe_layer(i) for i in range(5)] == [True, False, True, False, True]
    pattern = MoESettings(num_experts=4, moe_layer_freq=(0, 1, 1, 1))
    assert [pattern.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


def test_aux_loss_coefficients_by_type():
    s = MoESettings(num_experts=4, moe_router_load_balancing_type=("aux_loss", "global_aux_loss"),
                    moe_aux_loss_coeff=(0.1, 0.2))
    coeffs = [s.aux_loss_coeff(kind) for kind in ("aux_loss", "global_aux_loss", "seq_aux_loss")]
    assert coeffs == [0.1, 0.2, 0.0]


@pytest.mark.parametrize("text, value", [
    ("1", 1), ("2", 2), ("([0]*1+[1]*3)", (0, 1, 1, 1)), ("([1]*3+[0]*1)*2", (1, 1, 1, 0) * 2),
    ("[1,0,1,0]", (1, 0, 1, 0)), ("2*[0]", (0, 0)),
])
def test_parse_moe_layer_freq(text, value):
    assert parse_moe_layer_freq(text) == value


@pytest.mark.parametrize("text", ["two", "[1, 'a']", "__import__('os')", "[1]+2", "[1.5]*2", "[[1]]"])
def test_parse_moe_layer_freq_refuses_other_expressions(text):
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        parse_moe_layer_freq(text)
