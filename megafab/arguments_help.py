"""--help for Megatron's command line: every flag's text from its schema field's help, and the
flags listed under the argument groups Megatron-LM 0.16.1 puts them in.

arguments.py adds each flag where its config section lives; `document(parser)` fills in the help
text and regroups the flags for display. Parsing does not depend on either.
"""

from __future__ import annotations

import argparse
import textwrap

from megafab.config import field_docs
from megafab.megatron_flags import NO_EFFECT, REFUSED

MEGAFAB_ONLY = "megafab (not Megatron flags)"
NO_EFFECT_GROUP = "Megatron flags accepted without effect in megafab"

# Megatron's group titles in the order its --help lists them, then megafab's own.
GROUP_ORDER = ("transformer configuration", "network size", "regularization", "profiling", "training",
               "RNG and initialization", "learning rate and weight decay", "checkpointing",
               "mixed precision", "distributed", "validation", "data and dataloader", "tokenizer",
               "moe", "multi-token prediction", "logging", "experimental", MEGAFAB_ONLY, NO_EFFECT_GROUP)

# Where a flag goes by the arguments.py group that defines it ...
GROUP_OF_SECTION = {"model": "transformer configuration", "mixture of experts": "transformer configuration",
                    "activation recompute": "transformer configuration",
                    "parallelism": "distributed", "precision": "mixed precision",
                    "optimizer and learning rate": "learning rate and weight decay", "training": "training",
                    "data and tokenizer": "data and dataloader", "checkpointing": "checkpointing",
                    "logging": "logging", "configuration files": "experimental",
                    "ZeRO-2/3 (FSDP) and optimizer CPU offload": "distributed"}

# ... unless Megatron puts it elsewhere.
_MEGATRON_GROUP = {
    "network size": "--group-query-attention --max-position-embeddings --position-embedding-type "
                    "--use-rotary-position-embeddings --no-position-embedding --rotary-base --rotary-percent "
                    "--swiglu --openai-gelu "
                    "--squared-relu --untie-embeddings-and-output-weights --make-vocab-size-divisible-by",
    "transformer configuration": "--tensor-model-parallel-size --pipeline-model-parallel-size "
                                 "--account-for-embedding-in-pipeline-split "
                                 "--account-for-loss-in-pipeline-split --expert-model-parallel-size "
                                 "--expert-tensor-parallel-size --sequence-parallel --fp16 --bf16 "
                                 "--fp8-format --fp8-recipe --fp8-margin --fp8-amax-history-len "
                                 "--fp8-amax-compute-algo --calculate-per-token-loss",
    "training": "--recompute-activations --gradient-accumulation-fusion --no-gradient-accumulation-fusion "
                "--optimizer --optimizer-cpu-offload --optimizer-offload-fraction --no-pin-cpu-grads "
                "--no-pin-cpu-params",
    "mixed precision": "--accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16",
    "regularization": "--weight-decay --clip-grad --adam-beta1 --adam-beta2 --adam-eps --sgd-momentum",
    "validation": "--eval-iters --eval-interval --skip-train",
    "RNG and initialization": "--seed",
    "profiling": "--profile --use-pytorch-profiler --profile-step-start --profile-step-end --profile-ranks",
    "data and dataloader": "--seq-length",
    "tokenizer": "--vocab-size --tokenizer-type --vocab-file --merge-file --tokenizer-model "
                 "--tiktoken-pattern --tiktoken-num-special-tokens --tokenizer-special-tokens "
                 "--trust-remote-code",
    "experimental": "--use-precision-aware-optimizer",
    MEGAFAB_ONLY: "--compile --dry-run --config --metrics-jsonl",
}
FLAG_GROUP = {flag: title for title, flags in _MEGATRON_GROUP.items() for flag in flags.split()}


def help_text(action: argparse.Action, docs: dict[str, str]) -> str | None:
    """The help of one flag: its own, else its schema field's help (+ the default for valued flags)."""
    flag = action.option_strings[0]
    if flag in NO_EFFECT:
        return f"accepted, no effect in megafab: {NO_EFFECT[flag]}"
    if action.help is not None:
        return action.help
    doc = docs.get(action.dest)
    if doc is None:
        return None
    text = doc.replace("%", "%%")
    if action.const is False:  # --no-X / --disable-X: the field's help describes X
        return f"turns off: {text}"
    valued = action.nargs != 0 and action.default is not None and action.default not in ("", [])
    return f"{text} (default: %(default)s)" if valued and "default" not in text else text


def refused_epilog() -> str:
    text = ("Refused by name (megafab does not implement them; a run with one stops with the reason): "
            + ", ".join(sorted(REFUSED)) + ".")
    return textwrap.fill(text, width=100, break_on_hyphens=False, break_long_words=False)


def document(parser: argparse.ArgumentParser) -> None:
    """Help text on every flag, and the flags regrouped under Megatron's group titles."""
    docs = field_docs()
    placement: list[tuple[str, argparse.Action]] = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            action.help = help_text(action, docs)
            flag = action.option_strings[0]
            title = NO_EFFECT_GROUP if flag in NO_EFFECT else \
                FLAG_GROUP.get(flag) or GROUP_OF_SECTION.get(group.title, group.title)
            placement.append((title, action))
    options = parser._optionals
    parser._action_groups = [options]
    options._group_actions = [a for a in options._group_actions if isinstance(a, argparse._HelpAction)]
    titles = sorted({t for t, _ in placement}, key=lambda t: (GROUP_ORDER + (t,)).index(t))
    groups = {t: parser.add_argument_group(t) for t in titles}
    for title, action in placement:
        groups[title]._group_actions.append(action)
    parser.epilog = refused_epilog()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keeps flags in the epilog whole
