"""Megatron-LM's command line, parsed into megafab's Config.

Thin on purpose: flag names, types and defaults as Megatron's `megatron/training/arguments.py`;
every derivation and check lives in config.py. A Megatron flag megafab does not implement is
refused by name, never ignored.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable

from megafab.arguments_help import document
from megafab.config import ATTENTION_BACKENDS, Config, ConfigError
from megafab.config_file import CONFIG_FLAGS, parser_defaults, split_config_files
from megafab.errors import exit_on_user_error
from megafab.launch import planned_world_size
from megafab.megatron_flags import NO_EFFECT, REFUSED, refused_problem


def _model_flags(p):
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--kv-channels", type=int)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated Megatron spelling of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true")
    g.add_argument("--squared-relu", action="store_true")
    g.add_argument("--apply-layernorm-1p", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS))
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                   help="default: local, or transformer_engine with --fp8-format (TE needs a GPU)")
    g.add_argument("--compile", action="store_true", dest="compile_layers",
                   help="megafab only, not a Megatron flag: torch.compile each transformer layer")
    r = p.add_argument_group("activation recompute")
    r.add_argument("--recompute-activations", action="store_true",
                   help="shortcut for --recompute-granularity selective")
    r.add_argument("--recompute-granularity", choices=["full", "selective"])
    r.add_argument("--recompute-method", choices=["uniform", "block"])
    r.add_argument("--recompute-num-layers", type=int)
    r.add_argument("--recompute-modules", nargs="*")


def _parallel_flags(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-comm-type", nargs="+", default=["p2p"],
                   help="p2p, allgather (or all_gather) or a2a; one value for every layer")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int)
    g.add_argument("--gradient-accumulation-fusion", action="store_true", default=True)
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", default=True)
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=float, default=10)


def _sharding_and_offload_flags(p):
    g = p.add_argument_group("ZeRO-2/3 (FSDP) and optimizer CPU offload")
    g.add_argument("--use-torch-fsdp2", action="store_true")
    g.add_argument("--use-megatron-fsdp", "--use-custom-fsdp", action="store_true", dest="use_megatron_fsdp")
    g.add_argument("--data-parallel-sharding-strategy",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward")
    g.add_argument("--optimizer-cpu-offload", action="store_true")
    g.add_argument("--optimizer-offload-fraction", type=float)
    g.add_argument("--no-pin-cpu-grads", action="store_false", dest="pin_cpu_grads")
    g.add_argument("--no-pin-cpu-params", action="store_false", dest="pin_cpu_params")
    g.add_argument("--use-precision-aware-optimizer", action="store_true")


def _precision_flags(p):
    g = p.add_argument_group("precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"])
    g.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "mxfp8", "blockwise"])
    g.add_argument("--fp8-margin", type=int, default=0)
    g.add_argument("--fp8-amax-history-len", type=int, default=1)
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"])


def _optimizer_flags(p):
    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-decay-samples", type=int)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-samples", type=int)
    g.add_argument("--lr-wsd-decay-iters", type=int)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--decoupled-lr", type=float)
    g.add_argument("--decoupled-min-lr", type=float)


def _training_flags(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--train-samples", type=int)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--skip-train", action="store_true")
    g.add_argument("--exit-interval", type=int)
    g.add_argument("--exit-duration-in-mins", type=float)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--rampup-batch-size", nargs="*", type=int, help="START INCREMENT SAMPLES")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=100,
                   help="megafab only: stop after this many skipped iterations in a row (0: never)")
    g.add_argument("--manual-gc", action="store_true")
    g.add_argument("--manual-gc-interval", type=int, default=0)
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2])
    g.add_argument("--dry-run", action="store_true",
                   help="megafab: check the flags and print the memory/FLOPs plan, start nothing")


def _data_flags(p):
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*")
    g.add_argument("--split", default=None)
    g.add_argument("--train-data-path", nargs="*")
    g.add_argument("--valid-data-path", nargs="*")
    g.add_argument("--test-data-path", nargs="*")
    g.add_argument("--data-cache-path")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--tokenizer-type", choices=[
        "GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
        "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer"])
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model")
    g.add_argument("--tiktoken-pattern", choices=["v1", "v2"])
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument("--tokenizer-special-tokens", "--tiktoken-special-tokens", nargs="+",
                   dest="tokenizer_special_tokens")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files")


def _checkpoint_flags(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--ckpt-format", default="torch_dist")
    g.add_argument("--auto-detect-ckpt-format", action="store_true")
    g.add_argument("--ckpt-step", type=int)
    g.add_argument("--pretrained-checkpoint")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")


def _logging_flags(p):
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--tensorboard-dir")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--wandb-project", default="")
    g.add_argument("--wandb-exp-name", default="")
    g.add_argument("--wandb-save-dir", default="")
    g.add_argument("--logging-level", type=int)
    g.add_argument("--profile", action="store_true")
    g.add_argument("--use-pytorch-profiler", action="store_true")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0])
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2])
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"])
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--wandb-entity", default="")
    g.add_argument("--metrics-jsonl")


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
    for add in (_model_flags, _parallel_flags, _precision_flags, _optimizer_flags, _training_flags,
                _data_flags, _checkpoint_flags, _logging_flags, _sharding_and_offload_flags,
                _config_file_flags):
        add(parser)
    for flag in NO_EFFECT:
        parser.add_argument(flag, action="store_true")
    document(parser)
    return parser


def _flag_name(token: str) -> str:
    return token.partition("=")[0]


def _is_flag(token: str) -> bool:
    return token.startswith("--")


def _take_values(argv: list[str], i: int) -> int:
    """Index after flag argv[i] and the values that follow it (up to the next --flag)."""
    j = i + 1
    if "=" not in argv[i]:
        while j < len(argv) and not _is_flag(argv[j]):
            j += 1
    return j


def split_refused(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without refused flags, one problem per refused flag). A refused flag given only its
    "off" value asks for nothing and is dropped silently."""
    kept, problems, i = [], [], 0
    while i < len(argv):
        name = _flag_name(argv[i])
        if name not in REFUSED:
            kept.append(argv[i])
            i += 1
            continue
        end = _take_values(argv, i)
        values = [argv[i].partition("=")[2]] if "=" in argv[i] else argv[i + 1:end]
        if not (len(values) == 1 and values[0] in REFUSED[name].off):
            problems.append(refused_problem(name))
        i = end
    return kept, problems


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


def _resolve_spellings(args: argparse.Namespace) -> None:
    """Megatron's deprecated spellings and shortcuts, mapped onto the fields they mean."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"
    if args.transformer_impl is None:  # FP8 exists only in Transformer Engine's layers
        args.transformer_impl = "transformer_engine" if args.fp8_format else "local"
    # Megatron's per-layer list; one distinct type is what megafab runs (config refuses several)
    args.cp_comm_type = " ".join(dict.fromkeys(args.cp_comm_type))


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
    if cfg.parallel.tensor_model_parallel_size == 1 and cfg.model.cross_entropy_loss_fusion:
        out.append("--cross-entropy-loss-fusion (with one tensor-parallel rank the cross entropy makes "
                   "no all-reduce to fuse)")
    return out


def _without_consequences(problems: list[str], broken: set[str]) -> list[str]:
    """Drop "--flag ... is required" lines for flags whose bad value or misspelling was reported."""
    return [p for p in problems
            if not any(p.startswith(f"{flag} ") and "is required" in p for flag in broken)]


def config_from_args(argv: list[str] | None = None, world_size: int | None = None,
                     checks: tuple[Callable[[Config], list[str]], ...] = ()) -> Config:
    """Parse, derive and validate one command line; every problem in it -> one ConfigError.

    Problems collected together: refused Megatron flags, unrecognized flags (with a did-you-mean),
    bad values, config rule violations, and what each of `checks` (the entry point's machine
    checks, e.g. Transformer Engine present) finds in the resolved config. A check must cope with a
    config that breaks other rules (they are all reported together).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    files, argv, problems = split_config_files(argv)
    file_values, file_problems, file_no_effect = parser_defaults(parser, files)
    problems += file_problems
    flag_defaults = {dest: parser.get_default(dest) for dest in file_values}
    parser.set_defaults(**file_values)
    kept, refused = split_refused(argv)
    problems += refused
    args, extras, parse_problems, broken = _parse_collecting(parser, kept)
    problems += parse_problems
    known = list(parser._option_string_actions) + list(REFUSED)
    unrecognized, suggested = _unrecognized(extras, known)
    problems += unrecognized
    if args is None:
        raise ConfigError(problems)
    _resolve_spellings(args)
    if world_size is None:
        world_size = planned_world_size(dry_run=args.dry_run)
    cfg = Config.from_flat(vars(args)).finalize(world_size, validate=False)
    given = _given_dests(parser, kept) | {d for d, v in file_values.items() if v != flag_defaults[d]}
    cfg.no_effect += no_effect_flags(cfg, given, kept) + file_no_effect
    problems += _without_consequences(cfg.problems(), broken | suggested)
    for check in checks:
        problems += check(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def config_or_exit(argv: list[str] | None = None, world_size: int | None = None,
                   checks: tuple[Callable[[Config], list[str]], ...] = ()) -> Config:
    """config_from_args for entry points: the one message from rank 0, exit status 2."""
    with exit_on_user_error():
        return config_from_args(argv, world_size, checks)
