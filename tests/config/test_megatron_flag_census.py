"""Every flag of Megatron-LM's own parser, core_v0.16.1's and HEAD's (at a pinned commit), from their
censuses (fixtures/megatron_flags.json and megatron_flags_head.json, written by
fixtures/make_megatron_flags.py from megatron.training.arguments), is honoured (parsed into megafab's
config), refused by name with its reason, or accepted and announced as having no effect; none is
"unrecognized", and each takes its values the way Megatron's parser does: its nargs, and every value
of its choices accepted or refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

import pretrain_gpt
from megafab.arguments import build_parser, config_from_args
from megafab.config import ConfigError
from megafab.megatron_flags import NARGS, NO_EFFECT, REFUSED, REFUSED_VALUES
from tests.helpers.flags import BASE

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _census(name: str) -> tuple[str, dict[str, dict]]:
    with open(os.path.join(FIXTURES, name)) as f:
        census = json.load(f)
    return census["commit"], census["flags"]


# release -> (Megatron-LM commit, {flag: its argparse facts}); CENSUS is 0.16.1's
CENSUSES = {"core_v0.16.1": _census("megatron_flags.json"), "head": _census("megatron_flags_head.json")}
CENSUS = CENSUSES["core_v0.16.1"][1]
HEAD = CENSUSES["head"][1]
RELEASES = list(CENSUSES)
# HEAD's flags that are features being built (issue 39), unknown meanwhile; delete a flag here when
# megafab honours it
LEFT_FOR_FEATURES: set[str] = set()
# Megatron's nargs for a flag that one release made a switch and another a one-value flag (megafab
# takes either: "?"), or a list of any length and another one or more (megafab takes any: "*")
LOOSER = {"?": (0, None), "*": ("+",)}

# The Megatron flags megafab honours that have no field of their own name: aliases of fields.
ALIASES = {"--disable-manual-gc-eval": "manual_gc_eval", "--encoder-seq-length": "encoder_seq_length",
           "--disable-log-loss-scale-to-tensorboard": "log_loss_scale_to_tensorboard",
           "--persistent-save-interval": "save_interval"}


def _kinds(census: dict[str, dict] = CENSUS):
    actions = build_parser()._option_string_actions
    honoured = {f for f in census if f in actions and f not in NO_EFFECT}
    return actions, honoured


def _value(flag: str, avoid: tuple[str, ...] = (), census: dict[str, dict] = CENSUS) -> str:
    """A value Megatron's parser accepts for `flag`, none of `avoid` (a refused flag's off values)."""
    facts = census[flag]
    if facts["choices"]:
        return next(str(c) for c in facts["choices"] if str(c) not in avoid)
    return {"int": "3", "float": "0.25"}.get(facts["type"], "some-value")


def _megatron_tokens(flag: str, avoid: tuple[str, ...] = (), census: dict[str, dict] = CENSUS) -> list[str]:
    """`flag` with values in Megatron's syntax: none for a switch, one, or two for a list."""
    nargs = census[flag]["nargs"]
    if nargs == 0:
        return [flag]
    count = {None: 1, "+": 2, "*": 2}.get(nargs, nargs)
    return [flag] + [_value(flag, avoid, census)] * count


def _takes(ours, megatrons) -> bool:
    """megafab's nargs for a refused or no-effect flag takes what Megatron's does."""
    return ours == megatrons or megatrons in LOOSER.get(ours, ())


def _problems(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from_args(BASE + argv, world_size=1)
    return info.value.problems


def test_the_censuses_are_megatrons_whole_parsers():
    assert len(CENSUS) == 680  # add_megatron_arguments' "--" flags, --help aside
    assert len(HEAD) == 876
    assert CENSUSES["core_v0.16.1"][0] == "55ac7082517c3878ae653c07c09c534b8aed49f6"
    assert CENSUSES["head"][0] == "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
    for flag in ("--use-cpu-initialization", "--rerun-mode", "--num-layers", "--log-params-norm"):
        assert flag in CENSUS and flag in HEAD
    assert CENSUS["--rerun-mode"]["choices"] == ["disabled", "validate_results", "report_stats"]
    assert CENSUS["--exit-signal"]["default"] == "SIGTERM"
    # HEAD renamed and removed flags (0.16.1's spellings stay known to megafab), and added many
    assert "--hybrid-layer-pattern" in HEAD and "--hybrid-override-pattern" in HEAD
    assert "--muon-nesterov" in HEAD and "--muon-use-nesterov" not in HEAD
    assert (CENSUS["--lazy-mpu-init"]["nargs"], HEAD["--lazy-mpu-init"]["nargs"]) == (None, 0)


@pytest.mark.parametrize("release", RELEASES)
def test_every_megatron_flag_is_honoured_refused_or_no_effect(release):
    census = CENSUSES[release][1]
    actions, honoured = _kinds(census)
    unknown = {f for f in census if f not in actions and f not in REFUSED}
    assert unknown == (LEFT_FOR_FEATURES - set(REFUSED) if release == "head" else set())
    assert not set(REFUSED) & set(actions)  # refused flags are never parsed into the config
    assert not set(NO_EFFECT) & honoured
    # a no-effect flag's value lands where no config field reads it
    fields = {a.dest for f, a in actions.items() if f not in NO_EFFECT}
    assert not {actions[f].dest for f in NO_EFFECT} & fields
    for flag, dest in ALIASES.items():  # (--encoder-seq-length: its own dest, mapped onto seq_length)
        assert actions[flag].dest == dest and flag in honoured
    refused, no_effect = set(census) & set(REFUSED), set(census) & set(NO_EFFECT)
    assert len(honoured) + len(refused) + len(no_effect) + len(unknown) == len(census)


def test_encoder_seq_length_is_megatrons_older_seq_length():
    argv = [t for t in BASE if t not in ("--seq-length", "32")]
    assert len(argv) == len(BASE) - 2
    assert config_from_args(argv + ["--encoder-seq-length", "64"], world_size=1).model.seq_length == 64
    assert "--encoder-seq-length: Megatron's older name for --seq-length, given with --seq-length; give " \
           "one of the two" in _problems(["--encoder-seq-length", "64"])


@pytest.mark.parametrize("release", RELEASES)
def test_refused_and_no_effect_flags_take_megatrons_nargs(release):
    census = CENSUSES[release][1]
    mismatched = {f: (NARGS.get(f, 0), census[f]["nargs"]) for f in list(REFUSED) + list(NO_EFFECT)
                  if f in census and f not in LEFT_FOR_FEATURES
                  and not _takes(NARGS.get(f, 0), census[f]["nargs"])}
    assert mismatched == {}
    assert set(NARGS) <= set(REFUSED) | set(NO_EFFECT)


def test_megafab_takes_looser_nargs_only_where_the_releases_differ():
    looser = {f for f in set(NARGS) - LEFT_FOR_FEATURES
              if any(f in census and NARGS[f] != census[f]["nargs"] for _, census in CENSUSES.values())}
    differ = {f for f in set(CENSUS) & set(HEAD) & (set(REFUSED) | set(NO_EFFECT))
              if CENSUS[f]["nargs"] != HEAD[f]["nargs"]}
    assert looser == differ == {"--lazy-mpu-init", "--high-priority-stream-groups"}


def _megatrons_choices(flag: str) -> set[str]:
    return {str(c) for _, census in CENSUSES.values() if flag in census
            for c in census[flag]["choices"] or ()}


@pytest.mark.parametrize("release", RELEASES)
def test_honoured_flags_take_megatrons_values(release):
    """Megatron's nargs, and its choices: each either in megafab's (none outside Megatron's, of either
    release) or refused by name (REFUSED_VALUES)."""
    census = CENSUSES[release][1]
    actions, honoured = _kinds(census)
    for flag in sorted(honoured):
        nargs, megatron = actions[flag].nargs, census[flag]["nargs"]
        if megatron == 0:
            assert nargs == 0, flag
        elif megatron is None:
            assert nargs is None, flag
        else:  # a list: megafab's nargs accepts Megatron's count (the rules check it further)
            assert nargs in ("*", "+", megatron), flag
        ours, refused = actions[flag].choices, set(REFUSED_VALUES.get(flag, ()))
        if census[flag]["choices"] is not None and ours is not None:  # (None: megafab's rules check them)
            assert set(map(str, ours)) <= _megatrons_choices(flag), flag
            assert set(map(str, census[flag]["choices"])) <= set(map(str, ours)) | refused, flag
            assert not refused & set(map(str, ours)), flag
    assert set(REFUSED_VALUES) <= honoured | (set(HEAD) - set(census))


def test_each_refused_value_of_an_honoured_flag_is_reported_by_name():
    for flag, values in REFUSED_VALUES.items():
        for value in values:
            assert value in _megatrons_choices(flag), (flag, value)
            for argv in ([flag, value], [f"{flag}={value}"]):
                assert f"{flag} {value}: refused, {values[value]}; choose another value" in _problems(argv)
    problems = _problems(["--optimizer", "lion", "--moe-router-score-function", "sqrtsoftplus"])
    assert [p.split(":")[0] for p in problems] == ["--optimizer lion",
                                                   "--moe-router-score-function sqrtsoftplus"]
    assert config_from_args(BASE + ["--optimizer", "sgd"], world_size=1).optimizer.optimizer == "sgd"


def test_lazy_mpu_init_is_refused_as_either_release_writes_it():
    for argv in (["--lazy-mpu-init", "true"], ["--lazy-mpu-init"]):  # 0.16.1: one value; HEAD: a switch
        problems = _problems(argv + ["--use-cpu-initialization"])
        assert len(problems) == 1 and problems[0].startswith("--lazy-mpu-init: refused")


@pytest.mark.parametrize("release", RELEASES)
def test_every_refused_flag_is_reported_by_name_with_megatrons_values(release):
    """All of them on one command line, each with values as Megatron's parser takes them: one
    problem each, naming the flag and its reason, and no value left over as unrecognized."""
    census = CENSUSES[release][1]
    refused = [f for f in census if f in REFUSED]
    argv = [t for f in refused
            for t in _megatron_tokens(f, REFUSED[f].off + tuple(dict(REFUSED[f].no_effect)), census)]
    problems = _problems(argv)
    assert not [p for p in problems if "unrecognized" in p or "unexpected value" in p]
    for flag in refused:
        assert f"{flag}: refused, {REFUSED[flag].reason}; remove it (megafab never ignores a flag)" \
            in problems
    assert len(problems) == len(refused)


def test_refused_flags_off_values_ask_for_nothing():
    argv = [t for f, r in REFUSED.items() for value in r.off[:1] for t in (f, value)]
    assert len(argv) >= 2 * 15  # (fewer as refused features are implemented: --rope-type's went)
    cfg = config_from_args(BASE + argv, world_size=1)
    assert not [n for n in cfg.no_effect if n.split()[0] in REFUSED]
    cfg = config_from_args(BASE + ["--rerun-mode", "disabled", "--exit-signal", "SIGTERM",
                                   "--exp-avg-dtype=fp32"], world_size=1)
    assert list(cfg.no_effect) == []


def test_megatrons_default_rerun_mode_is_accepted_and_says_what_megafab_does():
    cfg = config_from_args(BASE + ["--rerun-mode", "validate_results"], world_size=1)
    assert list(cfg.no_effect) == [
        "--rerun-mode validate_results (megafab has no rerun state machine: a nan or inf loss or gradient "
        "stops the run with the iteration and ranks (--check-for-nan-in-loss-and-grad) instead of "
        "re-running the iteration to classify the fault)"]
    assert any(p.startswith("--rerun-mode: refused, Megatron's rerun state machine")
               for p in _problems(["--rerun-mode", "report_stats"]))
    assert any(p.startswith("--exit-signal: refused") for p in _problems(["--exit-signal", "SIGUSR1"]))


@pytest.mark.parametrize("release", RELEASES)
def test_every_no_effect_flag_is_accepted_with_megatrons_values_and_announced(release):
    census = CENSUSES[release][1]
    no_effect = [f for f in census if f in NO_EFFECT]
    argv = [t for f in no_effect for t in _megatron_tokens(f, census=census)]
    cfg = config_from_args(BASE + argv, world_size=1)
    announced = [n.split(" (", 1)[0] for n in cfg.no_effect]
    assert announced == no_effect
    for flag in no_effect:
        assert f"{flag} ({NO_EFFECT[flag]})" in cfg.no_effect


def test_a_switch_takes_no_value_as_in_megatron():
    """A refused or no-effect switch leaves the next token alone: a stray value is reported, as
    Megatron's argparse stops on it, instead of being swallowed."""
    for flag in ("--qk-l2-norm", "--use-cpu-initialization"):
        problems = _problems([flag, "true"])
        assert "'true': unexpected value on the command line (every value follows its --flag)" in problems
    # ... and a one-value flag takes exactly one, also one that looks like a negative number
    problems = _problems(["--rl-default-top-k", "-1", "7"])
    assert "'7': unexpected value on the command line (every value follows its --flag)" in problems
    assert any(p.startswith("--rl-default-top-k: refused") for p in problems)
    cfg = config_from_args(BASE + ["--tp-comm-overlap-cfg", "ub.yaml", "--local-rank=3"], world_size=1)
    assert len(cfg.no_effect) == 2


def test_the_entry_point_stops_on_a_refused_flag_with_exit_2_before_any_process_group(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as info:
        pretrain_gpt.main(BASE + ["--use-mup", "--no-rope-freq", "4", "--dry-run"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megafab: error:")
    assert "--use-mup: refused, the maximal update parameterization" in err
    assert "--no-rope-freq: refused, this RoPE variant" in err
    assert "unrecognized" not in err
    assert not dist.is_initialized()


def test_kernel_fusion_choices_are_accepted_and_announced_as_no_effect():
    """Megatron's fused kernels that compute the unfused values: accepted, each announced once."""
    moe = ["--num-experts", "4", "--moe-router-topk", "2"]
    cfg = config_from_args(BASE + moe + ["--moe-router-fusion", "--moe-permute-fusion",
                                         "--cross-entropy-fusion-impl", "te", "--fused-residual-rmsnorm"],
                           world_size=1)
    assert sorted(n.split(" (")[0] for n in cfg.no_effect) == [
        "--cross-entropy-fusion-impl", "--fused-residual-rmsnorm", "--moe-permute-fusion",
        "--moe-router-fusion"]
    assert cfg.moe.moe_permute_fusion  # (TE's permutation with --transformer-impl transformer_engine)
