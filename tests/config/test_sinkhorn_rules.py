"""--moe-router-load-balancing-type sinkhorn's rules: what megatron-core 0.16.1 asserts with it (a zero
aux-loss coefficient, no capacity factor), sinkhorn in a list (which megatron-core then skips), and
each routing flag its sinkhorn ignores: one line of the one configuration message each, exit 2 and
no traceback; top-1 without --moe-router-pre-softmax is fine with sinkhorn (megatron-core's rule)."""

import pytest

from megafab.arguments import config_from_args
from megafab.cli.pretrain import main
from megafab.config import ConfigError
from tests.helpers.flags import tiny_flags

BASE = tiny_flags() + ["--micro-batch-size", "1", "--mock-data", "--vocab-size", "100", "--lr", "1e-4",
                       "--train-iters", "10", "--num-experts", "8", "--moe-router-topk", "2"]
SINKHORN = ["--moe-router-load-balancing-type", "sinkhorn"]
WITH = "with --moe-router-load-balancing-type sinkhorn"
IGNORED = f"has no effect {WITH}; megatron-core's sinkhorn ignores it; drop it"

RULES = [  # (flags, the one line)
    (SINKHORN + ["--moe-aux-loss-coeff", "1e-2"],
     f"--moe-aux-loss-coeff 0.01 must be 0 {WITH} (it has no auxiliary loss; megatron-core asserts it); "
     f"drop --moe-aux-loss-coeff"),
    (["--moe-router-load-balancing-type", "sinkhorn", "aux_loss", "--moe-aux-loss-coeff", "0", "1e-2"],
     "--moe-router-load-balancing-type sinkhorn cannot be combined with other types (megatron-core then "
     "skips sinkhorn routing); give sinkhorn alone"),
    (SINKHORN + ["--moe-expert-capacity-factor", "1.0"],
     f"--moe-expert-capacity-factor 1.0 {WITH}: megatron-core drops tokens only with aux_loss, "
     f"seq_aux_loss, global_aux_loss or none; drop --moe-expert-capacity-factor"),
    (SINKHORN + ["--moe-router-score-function", "sigmoid"],
     f"--moe-router-score-function sigmoid has no effect {WITH} (its scores: sigmoid at --moe-router-topk "
     f"1, softmax above); megatron-core's sinkhorn ignores it; drop it"),
    (SINKHORN + ["--moe-router-pre-softmax"], f"--moe-router-pre-softmax {IGNORED}"),
    (SINKHORN + ["--moe-router-topk-scaling-factor", "2.5"],
     f"--moe-router-topk-scaling-factor 2.5 {IGNORED}"),
    (SINKHORN + ["--moe-router-num-groups", "4", "--moe-router-group-topk", "2"],
     f"--moe-router-group-topk 2 {IGNORED}"),
]


@pytest.mark.parametrize("flags, line", RULES, ids=[f"{i}{r[1].split(' ')[0]}" for i, r in enumerate(RULES)])
def test_each_sinkhorn_rule_is_one_line(flags, line):
    with pytest.raises(ConfigError) as err:
        config_from_args(BASE + flags, world_size=1)
    assert err.value.problems == [line]


def test_expert_bias_with_sinkhorn_is_refused():
    """(Its score function's line comes too: the bias needs sigmoid, which sinkhorn ignores.)"""
    flags = SINKHORN + ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]
    with pytest.raises(ConfigError) as err:
        config_from_args(BASE + flags, world_size=1)
    problems = err.value.problems
    assert len(problems) == 2 and problems[0].startswith("--moe-router-score-function sigmoid"), problems
    assert problems[1] == f"--moe-router-enable-expert-bias {IGNORED}"


def test_sinkhorn_rule_exits_2_without_traceback(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(BASE + RULES[0][0])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("problem(s) in the configuration") == 1 and err.count(RULES[0][1]) == 1, err
    assert "Traceback" not in err


def test_megatron_sinkhorn_settings_are_accepted():
    """Megatron's functional tests' sinkhorn flags: top-1 without pre-softmax, the default coefficient."""
    cfg = config_from_args(BASE + SINKHORN + ["--moe-router-topk", "1", "--moe-z-loss-coeff", "1e-3",
                                              "--moe-input-jitter-eps", "0.01"], world_size=1)
    assert (cfg.moe.moe_router_load_balancing_type, cfg.moe.moe_router_topk) == ("sinkhorn", 1)
