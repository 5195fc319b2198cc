"""--help: every flag of pretrain_gpt.py has help text, under a Megatron group title."""

import argparse
import os
import subprocess
import sys

from megafab.arguments import build_parser
from megafab.arguments_help import GROUP_ORDER, NO_EFFECT_GROUP
from megafab.config import field_docs
from megafab.megatron_flags import NO_EFFECT, REFUSED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flag_actions(parser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_no_flag_without_help():
    parser = build_parser()
    missing = [a.option_strings[0] for a in flag_actions(parser)
               if not a.help or a.help == argparse.SUPPRESS or not a.help.strip()]
    assert missing == []
    assert len(flag_actions(parser)) > 150


def test_help_comes_from_the_field_docstrings():
    parser = build_parser()
    helps = {a.option_strings[0]: a.help for a in flag_actions(parser)}
    docs = field_docs()
    assert helps["--num-layers"] == docs["num_layers"]
    assert helps["--lr-decay-style"].startswith(docs["lr_decay_style"]) and "(default: %(default)s)" in \
        helps["--lr-decay-style"]
    assert helps["--no-mmap-bin-files"] == "turns off: " + docs["mmap_bin_files"]
    assert helps["--use-mcore-models"] == "accepted, no effect in megafab: " + NO_EFFECT["--use-mcore-models"]


def test_flags_sit_under_megatron_groups():
    parser = build_parser()
    where = {a.option_strings[0]: g.title for g in parser._action_groups for a in g._group_actions}
    assert {g.title for g in parser._action_groups} <= set(GROUP_ORDER) | {"options"}
    # Megatron-LM 0.16.1's placement of a few flags megafab defines elsewhere
    assert where["--num-layers"] == "transformer configuration"
    assert where["--swiglu"] == "network size"
    assert where["--seed"] == "RNG and initialization"
    assert where["--weight-decay"] == "regularization"
    assert where["--eval-interval"] == "validation"
    assert where["--tokenizer-type"] == "tokenizer"
    assert where["--timing-log-level"] == "logging"
    assert all(where[flag] == NO_EFFECT_GROUP for flag in NO_EFFECT)


def test_help_output_lists_every_flag_and_the_refused_ones(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT,
                                                              "COLUMNS": "200"}, timeout=120)
    assert out.returncode == 0, out.stderr
    for action in flag_actions(build_parser()):
        assert action.option_strings[0] in out.stdout
    epilog = " ".join(out.stdout.split("Refused by name")[1].split())
    assert all(flag in epilog for flag in REFUSED)


def test_preprocess_has_no_flag_without_help():
    from megafab.data.preprocess.cli import build_parser as preprocess_parser

    assert [a.option_strings[0] for a in flag_actions(preprocess_parser()) if not a.help] == []
