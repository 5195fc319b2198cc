"""Config files: flag values from TOML or YAML (`--config FILE`, Megatron's `--yaml-cfg FILE`), and
the resolved configuration of a run written back as TOML, which `--config` reads again.

A file holds `name = value` pairs, the flags' dest names (`num_layers = 24`; dashes allowed:
`num-layers`), at the top level or under tables named after megafab's config sections ([model],
[parallel], ...) or Megatron's YAML sections (language_model, model_parallel). Values are checked
like the flags' (type, choices). The file's values replace the flags' defaults, so any flag on the
command line overrides them; with several files, a later one overrides an earlier one.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os

from megafab.config import SECTIONS
from megafab.megatron_flags import NO_EFFECT, REFUSED, refused_problem

CONFIG_FLAGS = ("--config", "--yaml-cfg")
TABLES = tuple(SECTIONS) + ("language_model", "model_parallel")
# Megatron's YAML (TransformerConfig) spellings of megafab's fields.
ALIASES = {"layernorm_epsilon": "norm_epsilon", "layernorm_zero_centered_gamma": "apply_layernorm_1p",
           "fp8": "fp8_format"}
ACTIVATIONS = {"swiglu": {"swiglu": True}, "squaredrelu": {"squared_relu": True}, "gelu": {}}


def split_config_files(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(config files in command-line order, argv without them, problems)."""
    files, rest, problems, i = [], [], [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name not in CONFIG_FLAGS:
            rest.append(argv[i])
            i += 1
        elif eq:
            files.append(value)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            files.append(argv[i + 1])
            i += 2
        else:
            problems.append(f"{name}: expected one FILE (.toml, .yaml or .yml)")
            i += 1
    return files, rest, problems


def _load(path: str):
    suffix = os.path.splitext(path)[1].lower()
    with open(path, "rb") as f:
        if suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib
            return tomllib.load(f)
        import yaml

        return yaml.safe_load(f)


def read_config_file(path: str) -> tuple[list[tuple[str, object]], list[str]]:
    """([(dest, value)] in file order, problems) of one file."""
    if os.path.splitext(path)[1].lower() not in (".toml", ".yaml", ".yml"):
        return [], [f"{path}: a config file must be TOML (.toml) or YAML (.yaml, .yml)"]
    if not os.path.isfile(path):
        return [], [f"{path}: no such config file"]
    try:
        data = _load(path)
    except Exception as err:  # noqa: BLE001 - tomllib and yaml raise their own error types
        return [], [f"{path}: not valid {os.path.splitext(path)[1][1:].upper()}: "
                    f"{' '.join(str(err).split())}"]
    if data is None:
        return [], []
    if not isinstance(data, dict):
        return [], [f"{path}: expected name = value pairs (a table / mapping) at the top level"]
    entries, problems = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            if _dest(key) not in TABLES:
                problems.append(f"{path}: [{key}] is not one of the tables {', '.join(TABLES)}")
                continue
            entries += [(_dest(k), v) for k, v in value.items()]
        else:
            entries.append((_dest(key), value))
    return _expand_aliases(entries), problems


def _dest(key) -> str:
    return str(key).lstrip("-").replace("-", "_")


def _expand_aliases(entries):
    out = []
    for key, value in entries:
        if key == "activation_func" and value in ACTIVATIONS:
            out += list(ACTIVATIONS[value].items())
        else:
            out.append((ALIASES.get(key, key), value))
    return out


def _convert(action: argparse.Action, value):
    """value as the flag would have parsed it, or raise ValueError with the reason."""
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        return [_scalar(action, v) for v in items]
    return _scalar(action, value)


def _scalar(action: argparse.Action, value):
    if isinstance(value, list) and action.nargs is None and action.type not in (None, int, float, str):
        value = str(value)  # a field's own parser reads a list as its text (--moe-layer-freq "[0, 1, 1]")
    if isinstance(value, (dict, list)) or isinstance(value, bool) and action.type is not None:
        raise ValueError(f"expected one {getattr(action.type, '__name__', 'str')}, got {value!r}")
    kind = action.type or str
    if kind is int and isinstance(value, float):
        raise ValueError(f"expected an integer, got {value!r}")
    converted = kind(value)
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"{converted!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def _value_action(actions: list[argparse.Action]) -> argparse.Action:
    """The action that stores a dest from a value (else the first of its on/off switches)."""
    return next((a for a in actions if a.nargs != 0), actions[0])


def parser_defaults(parser: argparse.ArgumentParser, files: list[str]) -> tuple[dict, list[str], list[str]]:
    """({dest: value} to set as the parser's defaults, problems, no-effect notes) of the files."""
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            by_dest.setdefault(action.dest, []).append(action)
    refused = {_dest(flag): flag for flag in REFUSED}
    no_effect = {_dest(flag): flag for flag in NO_EFFECT}
    values, problems, notes = {}, [], []
    for path in files:
        entries, file_problems = read_config_file(path)
        problems += file_problems
        for dest, value in entries:
            where = f"{path}: {dest}"
            if dest in refused:
                flag = refused[dest]
                announced = dict(REFUSED[flag].no_effect)
                if str(value) in announced:  # as on the command line (arguments.py)
                    notes.append(f"{flag} {value} ({announced[str(value)]}; from {path})")
                elif value not in (None, False) and str(value) not in REFUSED[flag].off:
                    problems.append(f"{where}: {refused_problem(flag)}")
                continue
            if dest not in by_dest or dest == "config_files":
                guess = difflib.get_close_matches(dest, list(by_dest) + list(refused), n=1, cutoff=0.7)
                hint = f" (did you mean {guess[0]}?)" if guess else ""
                problems.append(f"{where}: not a megafab flag{hint}; names are the flags' dest "
                                f"names, e.g. num_layers for --num-layers")
                continue
            action = _value_action(by_dest[dest])
            if value is None:
                if action.default is not None:
                    problems.append(f"{where}: needs a value (the flag's default is {action.default!r})")
                    continue
                values[dest] = None
                continue
            try:
                values[dest] = _convert(action, value)
            except (TypeError, ValueError) as err:
                problems.append(f"{where}: {err}")
                continue
            if dest in no_effect and values[dest]:
                notes.append(f"{no_effect[dest]} ({NO_EFFECT[no_effect[dest]]}; from {path})")
    return values, problems, notes


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) \
            else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)  # JSON's string escapes are TOML's


def resolved_config_toml(sections: dict[str, dict], settable: set[str], header: list[str]) -> str:
    """TOML of a resolved config: {section: {field: value}}; fields no flag sets (derived) and unset
    fields are written as comments, so `--config` reads the file back to the same configuration."""
    lines = [f"# {line}" for line in header]
    for section, fields in sections.items():
        lines += ["", f"[{section}]"]
        for name, value in fields.items():
            if name not in settable:
                shown = _toml_value(value) if value is not None else "(unset)"
                lines.append(f"# {name} = {shown}  (derived)")
            elif value is None:
                lines.append(f"# {name} = (unset)")
            else:
                lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
