"""The schema is the one place a flag is declared: the parser and --help come from it, unchanged."""

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from megafab.arguments import build_parser, config_from_args
from megafab.config import Config
from megafab.config.fields import field_default
from megafab.config.schema import SECTIONS, flag_fields
from tests.helpers.flags import tiny_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
# Captured from pretrain_gpt.py on main before the schema existed (commit 32be7ca):
# help_before.json: every action of the parser; help_before.txt: `COLUMNS=200 pretrain_gpt.py --help`
# (captured at 32be7ca; since then only the --init-model-with-meta-device note changed, on purpose,
# and the offload flags moved up inside the training group; issue 23 added megatron-core's MoE flags,
# --expert-model/tensor-parallel-size and --no-position-embedding, appended to both files, and took
# the first MoE flags off the refused list; the Megatron 0.16.1 census (test_megatron_flag_census.py)
# added --log-params-norm, the new no-effect flags (valued ones with a VALUE), Megatron's aliases
# --disable-manual-gc-eval, --disable-log-loss-scale-to-tensorboard and --persistent-save-interval on
# their fields, and the refused flags to the epilog's list; issue 37 appended multi-latent attention's
# and YaRN's flags and took them off the refused list, then Megatron-FSDP's two gradient dtypes, then
# --padded-vocab-size and --trust-remote-code, the Kimi-K2 bundle's; issue 38 appended --window-size,
# --window-attn-skip-freq and --softmax-type and took them off the refused list; issue 39's HEAD census
# appended HEAD's no-effect flags and --cross-entropy-fusion-impl (no longer refused), added HEAD's
# refused flags to the epilog, and reworded --moe-permute-fusion / --moe-router-fusion, no longer refused;
# then appended --eval-micro/global-batch-size and --step-batch-size-schedule, off the refused list,
# then --dataloader-inter-document-masking and --megatron-fsdp-main-params-dtype; then pretrain_gpt.py's
# ModelOpt flags, Megatron's functional tests', joined the epilog's refused list; then
# --use-checkpoint-args, --use-mp-args-from-checkpoint-args and --no-use-tokenizer-model-from-checkpoint-args
# (+ --disable-) were appended to the checkpointing group, off the refused and no-effect lists;
# --moe-router-load-balancing-type's help reworded: sinkhorn runs, no longer refused; then the
# functional-test corpus' flags --rotary-interleaved, --apply-query-key-layer-scaling,
# --check-weight-hash-across-dp-replicas-interval, --verify-integrity, --save-retain-interval and
# --use-tp-pp-dp-mapping were appended, off the epilog's refused list, then
# --microbatch-group-size-per-virtual-pipeline-stage, then --log-progress, off the epilog's refused list).
BEFORE = os.path.join(HERE, "help_before.json")
BEFORE_TEXT = os.path.join(HERE, "help_before.txt")
# The two parser defaults that now equal the schema's (both flags carry their own help text, so
# --help shows neither default): --transformer-impl was None until resolved, --cp-comm-type a list.
NOW_THE_SCHEMAS = {"--transformer-impl": (None, "local"), "--cp-comm-type": (["p2p"], "p2p")}


def flag_actions(parser):
    return [(g.title, a) for g in parser._action_groups for a in g._group_actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_field_parses_to_its_schema_default_and_choices():
    parser = build_parser("pretrain_gpt.py")
    by_dest = {}
    for _, action in flag_actions(parser):
        by_dest.setdefault(action.dest, []).append(action)
    fields = flag_fields()
    assert len(fields) > 150
    for _, f in fields:
        actions = by_dest.pop(f.name)
        want_choices = f.metadata["choices"]
        for action in actions:
            assert action.default == field_default(f), f.name
        choices = actions[0].choices
        assert (list(choices) if choices is not None else None) == \
            (list(want_choices) if want_choices is not None else None), f.name
    # what is left has no field: deprecated spellings, the config-file flag, no-effect flags
    leftover = {a.option_strings[0] for acts in by_dest.values() for a in acts}
    assert {"--use-rotary-position-embeddings", "--recompute-activations", "--no-position-embedding",
            "--config"} <= leftover
    # each switches something on (default False) or, as --no-position-embedding, off (default True)
    assert all(a.default is isinstance(a, argparse._StoreFalseAction) or a.default is None
               for acts in by_dest.values() for a in acts if a.nargs == 0)


def test_parsing_nothing_gives_the_dataclass_defaults():
    args = build_parser("pretrain_gpt.py").parse_args([])
    parsed = Config.from_flat(vars(args))
    for name in SECTIONS:
        assert getattr(parsed, name) == getattr(Config(), name), name


def test_arguments_py_writes_no_default_or_choice_list_of_a_field():
    source = open(os.path.join(ROOT, "megafab", "arguments.py")).read()
    assert re.findall(r"\bchoices=\[", source) == []
    assert re.findall(r"default=[^f]", source) == []  # only default=field_default(f)
    flags = {flag for _, f in flag_fields()
             for flag in (f.metadata["flags"] or (f"--{f.name.replace('_', '-')}",))}
    literal = set(re.findall(r'add_argument\("(--[a-z0-9-_]+)"', source))
    assert literal & flags == set()


def test_help_has_the_same_flags_groups_defaults_and_texts_as_before():
    before = json.load(open(BEFORE))
    now = {a.option_strings[0]: (title, a) for title, a in flag_actions(build_parser("pretrain_gpt.py"))}
    assert set(now) == {b["flags"][0] for b in before}
    for b in before:
        title, action = now[b["flags"][0]]
        assert (title, action.option_strings, action.dest, action.help, action.nargs, action.const,
                action.metavar, type(action).__name__) == \
            (b["group"], b["flags"], b["dest"], b["help"], b["nargs"], b["const"], b["metavar"],
             b["action"]), b["flags"][0]
        assert (list(action.choices) if action.choices is not None else None) == b["choices"]
        assert getattr(action.type, "__name__", None) == b["type"]
        default = NOW_THE_SCHEMAS.get(b["flags"][0], (b["default"], b["default"]))
        assert (b["default"], action.default) == default, b["flags"][0]


def test_help_text_is_unchanged_line_for_line():
    """The same lines as before (the order of a few flags inside their group may differ)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--help"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert Counter(out.stdout.splitlines()) == Counter(open(BEFORE_TEXT).read().splitlines())


BASE = tiny_flags(num_layers=2) + [
    "--micro-batch-size", "1", "--mock-data", "--vocab-size", "100", "--train-iters", "2", "--lr", "1e-3"]


def test_a_finalized_config_cannot_be_changed():
    cfg = config_from_args(BASE, world_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError, match="frozen after finalize"):
        cfg.model.num_layers = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.checkpoint.load = "elsewhere"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = cfg.model
    with pytest.raises(AttributeError):
        cfg.notes.append("a late note")  # notes and no_effect become tuples
    direct = Config.from_flat({"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                               "seq_length": 16, "micro_batch_size": 1, "mock_data": True, "vocab_size": 100,
                               "train_iters": 1, "lr": 1e-3}).finalize(world_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        direct.training.train_iters = 3
    # a new config is built instead, from the frozen one
    other = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load="elsewhere"))
    assert other.checkpoint.load == "elsewhere" and cfg.checkpoint.load is None


def test_the_vocabulary_is_sized_from_the_tokenizer_before_finalize():
    """NullTokenizer adds one eod id to --vocab-size (Megatron's); the padded size follows."""
    cfg = config_from_args(BASE + ["--make-vocab-size-divisible-by", "8"], world_size=1, start_up=True)
    assert (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (101, 104)
    assert cfg.model.frozen


def test_no_file_in_megafab_over_600_lines():
    long = []
    for folder, _, files in os.walk(os.path.join(ROOT, "megafab")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                lines = sum(1 for _ in open(path, encoding="utf-8"))
                if lines > 600:
                    long.append((os.path.relpath(path, ROOT), lines))
    assert long == []
