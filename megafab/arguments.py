"""Megatron-LM's command line, parsed into megafab's Config.

Thin on purpose: every flag of a config field is built from its declaration in
megafab/config/schema.py (names, types, defaults and choices as Megatron's
`megatron/training/arguments.py`); every derivation and check lives in megafab/config/. A Megatron
flag megafab does not implement is refused by name, never ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
import sys
import typing
from collections.abc import Callable

from megafab.arguments_help import document
from megafab.checkpoint.checkpoint_args import use_checkpoint_args
from megafab.checks import problems as config_problems
from megafab.checks.probes import start_up_problems, tokenizer_vocab_size
from megafab.checks.rules import padded_vocab_problems
from megafab.config import Config, ConfigError
from megafab.config.derive import derive_model
from megafab.config.fields import field_default, field_types
from megafab.config.moe import NEEDS_EXPERTS
from megafab.config.schema import SECTIONS, flag_fields
from megafab.config_file import CONFIG_FLAGS, parser_defaults, split_config_files
from megafab.megatron_flags import (
    NARGS,
    NO_EFFECT,
    REFUSED,
    REFUSED_VALUES,
    refused_problem,
    refused_value_problem,
)
from megafab.run.launch import planned_world_size
from megafab.run.report import exit_on_user_error

# The argparse group each section's flags are added to (arguments_help regroups them for display).
SECTION_GROUPS = {"model": "model", "moe": "mixture of experts", "parallel": "parallelism",
                  "precision": "precision",
                  "optimizer": "optimizer and learning rate", "data": "data and tokenizer",
                  "training": "training", "checkpoint": "checkpointing", "logging": "logging"}

# Megatron's deprecated spellings and shortcuts: flags with no field of their own, mapped onto the
# fields they mean by _resolve_spellings, listed in the group after the field they stand for.
# Each: (flag, help, its argparse keywords).
SPELLINGS = {"position_embedding_type": (
                 ("--use-rotary-position-embeddings",
                  "deprecated Megatron spelling of --position-embedding-type rope", {}),
                 ("--no-position-embedding",
                  "deprecated Megatron spelling of --position-embedding-type none: no learned position "
                  "table (with rope, which has none, it changes nothing)",
                  {"dest": "add_position_embedding", "action": "store_false"})),
             "recompute_granularity": (
                 ("--recompute-activations", "shortcut for --recompute-granularity selective", {}),),
             "seq_length": (
                 ("--encoder-seq-length", "Megatron's older name for --seq-length (give one of the two)",
                  {"action": "store", "type": int, "metavar": "ENCODER_SEQ_LENGTH"}),)}


def flag_kwargs(f: dataclasses.Field, kind: type) -> dict:
    """argparse's add_argument keywords for a schema field (see megafab/config/schema.py)."""
    meta = f.metadata
    kwargs = {"dest": f.name, "default": field_default(f), "help": meta["flag_help"]}
    action = meta["action"] or ("store_true" if kind is bool else None)
    if action:
        return {**kwargs, "action": action}
    element = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
    if meta["parse"] is not None:
        kwargs["type"] = _argparse_type(meta["parse"])
    elif element in (int, float):
        kwargs["type"] = element
    if meta["choices"] is not None:
        kwargs["choices"] = list(meta["choices"])
    if meta["nargs"] is not None:
        kwargs["nargs"] = meta["nargs"]
    return kwargs


def _argparse_type(parse):
    """A schema field's `parse` for argparse: its ValueError's own message, not "invalid value"."""
    if isinstance(parse, type):
        return parse

    @functools.wraps(parse)
    def convert(text):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return convert


def field_flags(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["flags"] or (f"--{f.name.replace('_', '-')}",)


def _schema_flags(p) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, f in flag_fields():
        title = f.metadata["group"] or SECTION_GROUPS[section]
        group = groups.get(title) or groups.setdefault(title, p.add_argument_group(title))
        group.add_argument(*field_flags(f), **flag_kwargs(f, field_types(SECTIONS[section])[f.name]))
        if f.metadata["negation"]:
            group.add_argument(f.metadata["negation"], action="store_false", dest=f.name)
        for flag, help_text, kwargs in SPELLINGS.get(f.name, ()):
            group.add_argument(flag, help=help_text, **{"action": "store_true", **kwargs})


def _config_file_flags(p):
    g = p.add_argument_group("configuration files")
    g.add_argument(*CONFIG_FLAGS, action="append", dest="config_files", metavar="FILE",
                   help="flag values from a TOML (.toml) or YAML (.yaml, .yml) file, as name = value "
                        "with the flags' dest names (num_layers = 24), optionally under [model], "
                        "[parallel], ... tables; flags on the command line override them; repeatable, "
                        "a later file overriding an earlier one (megafab reads --config; --yaml-cfg is "
                        "Megatron's name)")


class _Parser(argparse.ArgumentParser):
    """argparse that hands every problem back instead of printing usage and exiting."""

    def error(self, message):
        raise argparse.ArgumentError(None, message)


def _prog() -> str:
    """The name a user typed: Megatron's pretrain_gpt.py shim, else megafab's console script."""
    return "pretrain_gpt.py" if os.path.basename(sys.argv[0]) == "pretrain_gpt.py" else "megafab-pretrain"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    prog = prog or _prog()
    parser = _Parser(
        prog=prog, allow_abbrev=False, exit_on_error=False,
        usage="%(prog)s [--config FILE] [Megatron-LM flags ...]",
        description="Train a GPT with Megatron-style tensor, sequence, pipeline and data parallelism. "
                    "Flags are Megatron-LM's.")
    _schema_flags(parser)
    _config_file_flags(parser)
    for flag in NO_EFFECT:  # parsed as Megatron parses it (its values consumed), then announced
        nargs = NARGS.get(flag, 0)
        parser.add_argument(flag, action="store_true") if nargs == 0 else \
            parser.add_argument(flag, nargs=nargs, metavar="VALUE")
    document(parser)
    return parser


def _flag_name(token: str) -> str:
    return token.partition("=")[0]


def _is_flag(token: str) -> bool:
    return token.startswith("--")


def _take_values(argv: list[str], i: int, nargs: int | str | None = "*") -> int:
    """Index after flag argv[i] and the values that follow it: as many as `nargs` (argparse's: 0 a
    switch, None / "?" one at most, "*" / "+" up to the next --flag)."""
    j = i + 1
    if "=" not in argv[i]:
        most = {0: 0, None: 1, "?": 1}.get(nargs, nargs if isinstance(nargs, int) else len(argv))
        while j < len(argv) and j - i <= most and not _is_flag(argv[j]):
            j += 1
    return j


# One-value flags whose value a launch script's unquoted array expansion splits into words, as
# Megatron-LM HEAD's examples/gpt3/train_gpt3_175b_distributed.sh does its "0:16 2.4B:320 ..." (which
# Megatron's own parser then rejects): the words up to the next flag are the value, joined by spaces.
JOINED_VALUES = ("--step-batch-size-schedule",)


def join_split_values(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        end = _take_values(argv, i) if argv[i] in JOINED_VALUES else i + 1
        out += [argv[i]] + ([" ".join(argv[i + 1:end])] if end > i + 1 else [])
        i = end
    return out


def split_refused(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(argv without refused flags, one problem per refused flag, "--flag value (why)" per refused
    flag given a value that is accepted without effect). A refused flag takes the values Megatron's
    parser gives it (NARGS); given only its "off" value it asks for nothing and is dropped silently.
    An honoured flag given a value megafab refuses (REFUSED_VALUES) is one problem per such value."""
    kept, problems, notes, i = [], [], [], 0
    while i < len(argv):
        name = _flag_name(argv[i])
        if name in REFUSED_VALUES:
            end = _take_values(argv, i)
            values = [argv[i].partition("=")[2]] if "=" in argv[i] else argv[i + 1:end]
            refused_values = [v for v in values if v in REFUSED_VALUES[name]]
            problems += [refused_value_problem(name, v) for v in refused_values]
            if refused_values:
                i = end
                continue
        if name not in REFUSED:
            kept.append(argv[i])
            i += 1
            continue
        end = _take_values(argv, i, NARGS.get(name, 0))
        values = [argv[i].partition("=")[2]] if "=" in argv[i] else argv[i + 1:end]
        refused, accepted = REFUSED[name], dict(REFUSED[name].no_effect)
        if len(values) == 1 and values[0] in accepted:
            notes.append(f"{name} {values[0]} ({accepted[values[0]]})")
        elif not (len(values) == 1 and values[0] in refused.off):
            problems.append(refused_problem(name))
        i = end
    return kept, problems, notes


def _drop_flag(argv: list[str], option_strings: list[str]) -> list[str]:
    """argv without the first occurrence of the flag (and its values) that argparse choked on."""
    for i, token in enumerate(argv):
        if _flag_name(token) in option_strings:
            return argv[:i] + argv[_take_values(argv, i):]
    return argv


def _parse_collecting(parser, argv: list[str]):
    """parse_known_args, but every bad value is one problem instead of the end of parsing."""
    problems, broken = [], set()
    while True:
        try:
            args, extras = parser.parse_known_args(argv)
            return args, extras, problems, broken
        except argparse.ArgumentError as err:
            action = err.argument_name
            problems.append(f"{action}: {err.message}" if action else str(err.message))
            names = action.split("/") if action else []
            shorter = _drop_flag(argv, names)
            if shorter == argv:  # nothing left to drop: argparse's message is all there is
                return None, [], problems, broken
            argv = shorter
            broken.update(names)


def _unrecognized(extras: list[str], known: list[str]) -> tuple[list[str], set[str]]:
    """(one problem per unrecognized flag or stray value, the flags suggested instead)."""
    out, suggested, after_flag = [], set(), False
    for token in extras:
        if _is_flag(token):
            name = _flag_name(token)
            guess = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
            hint = f" (did you mean {guess[0]}?)" if guess else ""
            suggested.update(guess)
            out.append(f"{name}: unrecognized flag{hint}")
            after_flag = True
        elif not after_flag:
            out.append(f"{token!r}: unexpected value on the command line (every value follows its --flag)")
    return out, suggested


def _given_dests(parser, argv: list[str]) -> set[str]:
    actions = parser._option_string_actions
    return {actions[_flag_name(t)].dest for t in argv if _flag_name(t) in actions}


def _resolve_spellings(args: argparse.Namespace, named: set[str]) -> list[str]:
    """Megatron's deprecated spellings and shortcuts, mapped onto the fields they mean (`named`: the
    dests the command line or a config file set); the problems of a spelling given with its field."""
    problems = []
    if args.encoder_seq_length is not None:  # Megatron: seq_length = encoder_seq_length, never both
        if "seq_length" in named:
            problems.append("--encoder-seq-length: Megatron's older name for --seq-length, given with "
                            "--seq-length; give one of the two")
        else:
            args.seq_length = args.encoder_seq_length
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"  # the one rule: the model reads position_embedding_type
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"
    if args.fp8_format and "transformer_impl" not in named:  # FP8 exists only in Transformer Engine's layers
        args.transformer_impl = "transformer_engine"
    if isinstance(args.cp_comm_type, list):  # Megatron's per-layer list; the rules refuse several types
        args.cp_comm_type = " ".join(dict.fromkeys(args.cp_comm_type))
    return problems


def no_effect_flags(cfg: Config, given: set[str], argv: list[str]) -> list[str]:
    """"--flag (why)" for every given flag that changes nothing in this run."""
    out = [f"{_flag_name(t)} ({NO_EFFECT[_flag_name(t)]})" for t in argv if _flag_name(t) in NO_EFFECT]
    d, o, t, lg, pr = cfg.data, cfg.optimizer, cfg.training, cfg.logging, cfg.precision

    def unused(dests: list[str], why: str):
        out.extend(f"--{n.replace('_', '-')} ({why})" for n in dests if n in given)

    if d.tokenizer_type != "TikTokenizer":
        unused(["tiktoken_pattern", "tiktoken_num_special_tokens"],
               "only --tokenizer-type TikTokenizer reads it")
    if d.mock_data and "mmap_bin_files" in given:
        out.append("--no-mmap-bin-files (--mock-data reads no .bin files)")
    if d.dataloader_inter_document_masking:
        unused(["reset_position_ids", "reset_attention_mask"], "--dataloader-inter-document-masking "
               "restarts positions and masks attention at each document itself")
    if not d.reset_attention_mask and "create_attention_mask_in_dataloader" in given:
        out.append("--no-create-attention-mask-in-dataloader (megafab's data loader builds a mask only "
                   "for --reset-attention-mask; causal attention needs none)")
    if o.optimizer == "sgd":
        unused(["adam_beta1", "adam_beta2", "adam_eps"], "--optimizer sgd keeps no Adam moments")
    else:
        unused(["sgd_momentum"], "only --optimizer sgd has momentum")
    if not t.manual_gc:
        unused(["manual_gc_interval"], "only with --manual-gc")
        if "manual_gc_eval" in given:
            out.append("--no-manual-gc-eval (only with --manual-gc)")
    if not lg.profile:
        unused(["use_pytorch_profiler", "profile_step_start", "profile_step_end", "profile_ranks"],
               "only with --profile")
    if pr.fp8_format is None:
        unused(["fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo"],
               "only with --fp8-format")
    if cfg.moe.num_experts is None:  # a dense model: the MoE flags that are not refused then (rules.py)
        unused([f.name for f in dataclasses.fields(cfg.moe) if f.name not in NEEDS_EXPERTS + ("num_experts",)]
               + ["expert_tensor_parallel_size"], "only with --num-experts")
    else:
        moe = cfg.moe
        if moe.moe_shared_expert_intermediate_size is None:
            unused(["moe_shared_expert_gate", "moe_shared_expert_overlap"],
                   "only with --moe-shared-expert-intermediate-size")
        if not moe.moe_router_enable_expert_bias:
            unused(["moe_router_bias_update_rate"], "only with --moe-router-enable-expert-bias")
        if moe.moe_expert_capacity_factor is None:
            unused(["moe_token_drop_policy"], "only with --moe-expert-capacity-factor")
        if moe.moe_permute_fusion and cfg.model.transformer_impl != "transformer_engine":
            out.append("--moe-permute-fusion (Transformer Engine's fused token permutation, which megafab "
                       "runs with --transformer-impl transformer_engine; local layers permute unfused, "
                       "the same values)")
    if cfg.parallel.tensor_model_parallel_size == 1 and cfg.model.cross_entropy_loss_fusion:
        out.append("--cross-entropy-loss-fusion (with one tensor-parallel rank the cross entropy makes "
                   "no all-reduce to fuse)")
    return out


def _without_consequences(problems: list[str], broken: set[str]) -> list[str]:
    """Drop "--flag ... is required" lines for flags whose bad value or misspelling was reported."""
    return [p for p in problems
            if not any(p.startswith(f"{flag} ") and "is required" in p for flag in broken)]


def config_from_args(argv: list[str] | None = None, world_size: int | None = None,
                     checks: tuple[Callable[[Config], list[str]], ...] = (),
                     start_up: bool = False) -> Config:
    """Parse, derive, validate and freeze one command line; every problem in it -> one ConfigError.

    Problems collected together: refused Megatron flags, unrecognized flags (with a did-you-mean),
    bad values, config rule violations, and what each of `checks` (the entry point's machine
    checks, e.g. Transformer Engine present) finds in the resolved config. A check must cope with a
    config that breaks other rules (they are all reported together). `start_up` (a run's entry
    point): also the files the flags name (megafab/checks/probes.py), and the vocabulary sized from the
    tokenizer before the config is frozen.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    files, argv, problems = split_config_files(argv)
    file_values, file_problems, file_no_effect = parser_defaults(parser, files)
    problems += file_problems
    flag_defaults = {dest: parser.get_default(dest) for dest in file_values}
    parser.set_defaults(**file_values)
    kept, refused, refused_notes = split_refused(join_split_values(argv))
    problems += refused
    args, extras, parse_problems, broken = _parse_collecting(parser, kept)
    problems += parse_problems
    known = list(parser._option_string_actions) + list(REFUSED)
    unrecognized, suggested = _unrecognized(extras, known)
    problems += unrecognized
    if args is None:
        raise ConfigError(problems)
    given = _given_dests(parser, kept) | {d for d, v in file_values.items() if v != flag_defaults[d]}
    ckpt_notes, ckpt_fallbacks, ckpt_problems = use_checkpoint_args(args)  # Megatron: before validation
    problems += ckpt_problems
    problems += _resolve_spellings(args, given | set(file_values))
    if world_size is None:
        world_size = planned_world_size(dry_run=args.dry_run)
    cfg = Config.from_flat(vars(args)).resolve(world_size)
    cfg.notes += ckpt_notes + ckpt_fallbacks
    cfg.no_effect += refused_notes + no_effect_flags(cfg, given, kept) + file_no_effect
    problems += _without_consequences(config_problems(cfg), broken | suggested)
    for check in checks + ((start_up_problems,) if start_up else ()):
        problems += check(cfg)
    if problems:  # a flag the checkpoint did not provide is missing: say why it did not
        missing = any(p.endswith(" is required") for p in problems)
        raise ConfigError(problems + (ckpt_fallbacks if missing else []))
    if start_up:
        _size_vocabulary(cfg, keep_padded=args.padded_vocab_size is not None)  # given, or the checkpoint's
        if problems := padded_vocab_problems(cfg):  # the tokenizer's size, known only now
            raise ConfigError(problems)
    return cfg.freeze()


def _size_vocabulary(cfg: Config, keep_padded: bool = False) -> None:
    """The tokenizer's vocabulary size into the (not yet frozen) config, and the padded size derived
    from it, as Megatron does at start-up (a given --padded-vocab-size is kept, as Megatron uses it)."""
    m = cfg.model
    m.vocab_size = tokenizer_vocab_size(cfg)
    if not keep_padded:
        m.padded_vocab_size = None
    derive_model(m, cfg.parallel.tensor_model_parallel_size)


def config_or_exit(argv: list[str] | None = None, world_size: int | None = None,
                   checks: tuple[Callable[[Config], list[str]], ...] = (), start_up: bool = False) -> Config:
    """config_from_args for entry points: the one message from rank 0, exit status 2."""
    with exit_on_user_error():
        return config_from_args(argv, world_size, checks, start_up)
