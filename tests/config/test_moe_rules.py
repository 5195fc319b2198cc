"""The MoE rules of issue 23 (item 4) and the MoE asserts of Megatron's validate_args /
TransformerConfig that apply here: each is one line of the one configuration message, exit status
2, found before any process group starts (pretrain's main is run as rank 0 of a torchrun job with
init_process_group made to fail: the error must come first)."""

import pytest
import torch.distributed

from megafab.arguments import config_from_args
from megafab.cli.pretrain import main
from megafab.config import ConfigError
from tests.helpers.flags import tiny_flags

BASE = tiny_flags() + [
    "--micro-batch-size", "1", "--mock-data", "--vocab-size", "100", "--lr", "1e-4", "--train-iters", "10"]
MOE = ["--num-experts", "8", "--moe-router-topk", "2"]

# (what, flags, world size, the one line)
RULES = [
    ("experts not divisible by EP", ["--num-experts", "6", "--expert-model-parallel-size", "4"], 8,
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    ("world not divisible by the expert grid", MOE + ["--expert-model-parallel-size", "4"], 6,
     "world size 6 is not divisible by the expert grid --expert-tensor-parallel-size 1 x "
     "--expert-model-parallel-size 4 x --pipeline-model-parallel-size 1 = 4"),
    ("top-k above the experts", ["--num-experts", "4", "--moe-router-topk", "5"], 1,
     "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    ("top-k above what the groups allow",
     ["--num-experts", "8", "--moe-router-topk", "6", "--moe-router-num-groups", "4",
      "--moe-router-group-topk", "2"], 1, "needs 3 experts per group, but a group has 2"),
    ("group top-k without groups", MOE + ["--moe-router-group-topk", "2"], 1,
     "--moe-router-group-topk needs --moe-router-num-groups"),
    ("padding to capacity without a capacity", MOE + ["--moe-pad-expert-input-to-capacity"], 1,
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    ("flex dispatcher (DeepEP, GPU only)", MOE + ["--moe-token-dispatcher-type", "flex"], 1,
     "--moe-token-dispatcher-type flex (DeepEP / HybridEP, GPU-only kernels) is not supported"),
    ("shared-expert overlap without alltoall",
     MOE + ["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap",
            "--disable-bias-linear"], 1,
     "--moe-shared-expert-overlap works only with --moe-token-dispatcher-type alltoall"),
    ("MoE under TP without sequence parallelism",
     MOE + ["--tensor-model-parallel-size", "2", "--disable-bias-linear"], 2,
     "MoE layers with --tensor-model-parallel-size 2 need --sequence-parallel"),
    ("expert biases under ETP", MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "biases in MoE experts need --expert-tensor-parallel-size 1 (it is 2)"),
    ("expert width over ETP", MOE + ["--moe-ffn-hidden-size", "33", "--tensor-model-parallel-size", "2",
                                     "--sequence-parallel", "--disable-bias-linear"], 2,
     "--moe-ffn-hidden-size 33 is not divisible by --expert-tensor-parallel-size 2"),
    ("shared width over TP", MOE + ["--moe-shared-expert-intermediate-size", "33", "--sequence-parallel",
                                    "--disable-bias-linear",
                                    "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size",
                                    "1"], 2,
     "--moe-shared-expert-intermediate-size 33 is not divisible by --tensor-model-parallel-size 2"),
    ("shared experts with biases (megatron-core asserts)",
     MOE + ["--moe-shared-expert-intermediate-size", "64"], 1,
     "--moe-shared-expert-intermediate-size with biased linear layers (--add-bias-linear, Megatron's "
     "default): megatron-core's shared experts have no bias and refuse it; add --disable-bias-linear"),
    ("tp-pp-dp order with unequal DPs (Megatron asserts)",
     MOE + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
            "--use-tp-pp-dp-mapping"], 4,
     "--use-tp-pp-dp-mapping with --pipeline-model-parallel-size 2 needs the expert grid's data-parallel "
     "size (world / (ETP x EP x PP) = 1) to equal the dense grid's (world / (TP x CP x PP) = 2)"),
    ("EP without experts", ["--expert-model-parallel-size", "2"], 2,
     "--expert-model-parallel-size 2 needs --num-experts"),
    ("layer pattern of the wrong length", MOE + ["--moe-layer-freq", "([0]*1+[1]*2)"], 1,
     "--moe-layer-freq pattern has 3 entries for --num-layers 4"),
]


@pytest.mark.parametrize("what,flags,world,line", RULES, ids=[r[0] for r in RULES])
def test_each_moe_rule_is_one_line(what, flags, world, line):
    with pytest.raises(ConfigError) as err:
        config_from_args(BASE + flags, world_size=world)
    assert len(err.value.problems) == 1 and line in err.value.problems[0], err.value.problems


BEFORE_GROUPS = RULES[:2] + RULES[8:9]  # the layout rules: the ones a process group would meet


@pytest.mark.parametrize("what,flags,world,line", BEFORE_GROUPS, ids=[r[0] for r in BEFORE_GROUPS])
def test_moe_rule_exits_2_before_any_process_group(what, flags, world, line, monkeypatch, capsys):
    for name, value in {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)

    def no_group(*args, **kwargs):
        raise AssertionError("a process group was started before the configuration was checked")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_group)
    with pytest.raises(SystemExit) as exit_info:
        main(BASE + flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("problem(s) in the configuration") == 1 and err.count(line) == 1, err
    assert "Traceback" not in err


def test_mixtral_like_layout_and_etp_default():
    cfg = config_from_args(BASE + MOE + ["--expert-model-parallel-size", "8",
                                         "--pipeline-model-parallel-size", "4",
                                         "--moe-aux-loss-coeff", "1e-2", "--no-position-embedding"],
                           world_size=32)
    p, moe = cfg.parallel, cfg.moe
    assert (p.expert_model_parallel_size, p.expert_tensor_parallel_size, p.data_parallel_size) == (8, 1, 8)
    # Megatron's validate_args: a one-value list becomes the value; the experts' width defaults
    assert (moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff) == ("aux_loss", 0.01)
    assert moe.moe_ffn_hidden_size == cfg.model.ffn_hidden_size == 128
    assert cfg.model.position_embedding_type == "none"


def test_several_balancing_types_and_patterns_parse():
    cfg = config_from_args(BASE + MOE + ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
                                         "--moe-aux-loss-coeff", "1e-2", "1e-3",
                                         "--moe-layer-freq", "([0]*1+[1]*3)", "--position-embedding-type",
                                         "rope", "--no-position-embedding",
                                         "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                         "--expert-tensor-parallel-size", "1"], world_size=2)
    moe = cfg.moe
    assert moe.balancing_types == ("aux_loss", "seq_aux_loss")
    assert moe.aux_loss_coeff("seq_aux_loss") == 1e-3
    assert [moe.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert cfg.parallel.expert_tensor_parallel_size == 1
    assert cfg.model.position_embedding_type == "rope"  # rope has no learned table to turn off


def test_bad_layer_pattern_names_the_flag():
    with pytest.raises(ConfigError, match="--moe-layer-freq 'abc' is neither an int nor a pattern"):
        config_from_args(BASE + MOE + ["--moe-layer-freq", "abc"], world_size=1)


@pytest.mark.parametrize("flag", ["--moe-enable-deepep", "--moe-use-legacy-grouped-gemm",
                                  "--overlap-moe-expert-parallel-comm", "--moe-apply-probs-on-input"])
def test_megatron_moe_flags_without_a_field_are_refused_by_name(flag):
    with pytest.raises(ConfigError, match=f"{flag}: refused, "):
        config_from_args(BASE + MOE + [flag], world_size=1)


def test_every_megatron_moe_flag_is_a_field_refused_or_announced():
    """megatron-core 0.16.1's MoE and expert options (TransformerConfig's, which Megatron-LM turns
    into flags, less the three its arguments.py gives no flag of that name), and the ones its
    _add_moe_args adds: none is unknown to megafab. Read from the installed sources (importing
    megatron.core takes seconds)."""
    import importlib.util
    import os
    import re

    from megafab.arguments import build_parser
    from megafab.megatron_flags import NO_EFFECT, REFUSED

    core = importlib.util.find_spec("megatron.core").submodule_search_locations[0]
    source = "".join(open(os.path.join(core, *path)).read() for path in
                     (("model_parallel_config.py",), ("transformer", "transformer_config.py")))
    no_flag = {"num_moe_experts", "moe_token_dropping", "moe_router_topk_limited_devices"}
    names = [n for n in re.findall(r"^    ([a-z_0-9]+): ", source, re.M)
             if ("moe" in n or "expert" in n) and n not in no_flag]
    flags = {"--" + n.replace("_", "-") for n in names} | {
        "--num-experts", "--moe-use-upcycling", "--moe-upcycling-granularity",
        "--moe-pad-experts-for-cuda-graph-inference"}
    assert len(flags) > 40
    known = build_parser()._option_string_actions
    unknown = sorted(f for f in flags if f not in known and f not in REFUSED and f not in NO_EFFECT)
    assert unknown == []


def test_moe_flags_of_a_dense_model_are_announced_without_effect():
    cfg = config_from_args(BASE + ["--moe-router-topk", "4", "--moe-grouped-gemm",
                                   "--expert-tensor-parallel-size", "1"], world_size=1)
    assert cfg.no_effect == ("--moe-router-topk (only with --num-experts)",
                             "--moe-grouped-gemm (only with --num-experts)",
                             "--expert-tensor-parallel-size (only with --num-experts)")
    assert config_from_args(BASE + MOE + ["--moe-grouped-gemm"], world_size=1).no_effect == ()
    # the options of a part the MoE layer does not have
    cfg = config_from_args(BASE + MOE + ["--moe-shared-expert-gate", "--moe-router-bias-update-rate", "1e-2",
                                         "--moe-token-drop-policy", "position"], world_size=1)
    assert cfg.no_effect == ("--moe-shared-expert-gate (only with --moe-shared-expert-intermediate-size)",
                             "--moe-router-bias-update-rate (only with --moe-router-enable-expert-bias)",
                             "--moe-token-drop-policy (only with --moe-expert-capacity-factor)")
