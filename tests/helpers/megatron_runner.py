"""Megatron-LM's functional-test runner (tests/functional_tests/shell_test_utils/_run_training.sh at
d98e8a64dd): how it turns a case's model_config.yaml MODEL_ARGS into the training script's argument
list, with yq and bash, here in Python (tests/functional_corpus/make_corpus.py uses it)."""

from __future__ import annotations

import re
import shlex

import yaml


class _TextLoader(yaml.SafeLoader):
    """Every plain scalar kept as its text (what yq's `tostring` prints), anchors and `<<` merged
    (yq's `explode(.)`)."""


_TextLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag == "tag:yaml.org,2002:merge"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def yaml_as_text(text: str) -> dict:
    return yaml.load(text, Loader=_TextLoader)


def _trimmed(value: str) -> str:
    """`echo "$value" | xargs`: quotes removed, words joined by one space."""
    return " ".join(shlex.split(value)) if any(c in value for c in "'\"\\") else " ".join(value.split())


def model_args_words(model_args: dict | None) -> list[str]:
    """MODEL_ARGS -> TRAINING_PARAMS_ARRAY: `true` -> the bare flag; an empty value -> no flag (yq's
    select(.value != "")); `[a b]` -> the flag and the words inside; any other value one word (bash
    quotes a `(...)` value and one with spaces, `|` or parentheses; the rest has no space to split)."""
    words = []
    for key, value in (model_args or {}).items():
        if not isinstance(value, str) or "\n" in value:
            raise ValueError(f"{key}: {value!r} is no value the runner's line-by-line loop reads")
        if value == "":
            continue
        value = _trimmed(value)
        if value == "true":
            words.append(key)
        elif re.fullmatch(r"\[[^]]+\]", value):
            words += [key, *value[1:-1].split()]
        else:
            words += [key, value]
    return words
