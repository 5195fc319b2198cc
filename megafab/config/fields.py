"""How a config field is declared (`option`, `derived`) and the frozen-after-finalize sections;
megafab/config/schema.py declares the fields, megafab/arguments.py turns them into flags."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import field


def option(default, *, help: str, flags: tuple[str, ...] | None = None, choices: tuple | None = None,
           nargs: str | None = None, action: str | None = None, negation: str | None = None,
           group: str | None = None, flag_help: str | None = None, parse=None):
    """A field that is a command-line flag (see megafab/config/schema.py). `help` describes the field
    (--help shows it, with the default); `flag_help` replaces that text in --help for this flag;
    `parse` turns one command-line value into the field's value where the annotation alone does not
    say how (a union such as ``int | tuple[int, ...]``)."""
    meta = {"help": " ".join(help.split()), "flags": flags, "choices": choices, "nargs": nargs,
            "action": action, "negation": negation, "group": group, "flag_help": flag_help,
            "parse": parse}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def derived(default, *, help: str):
    """A field finalize computes (config/derive.py); no flag sets it."""
    return field(default=default, metadata={"help": " ".join(help.split()), "derived": True})


class Section:
    """Base of every section: writable while a config is built and derived, frozen by finalize."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: the configuration is frozen after finalize "
                f"(build a new one with dataclasses.replace before finalizing it)")
        object.__setattr__(self, name, value)

    def freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    def replaced(self, **changes):
        """A writable copy with `changes` assigned (frozen or not, `self` is left as it is): what
        dataclasses.replace gives for sections (no __post_init__, no init=False fields), without
        calling __init__ field by field (the layout search builds tens of thousands of configs)."""
        if not changes.keys() <= self.__dataclass_fields__.keys():
            unknown = sorted(changes.keys() - self.__dataclass_fields__.keys())
            raise TypeError(f"{type(self).__name__} has no field {', '.join(unknown)}")
        copy = object.__new__(type(self))
        state = copy.__dict__
        state.update(self.__dict__)
        state.pop("_frozen", None)
        state.update(changes)
        return copy

    @property
    def frozen(self) -> bool:
        return self.__dict__.get("_frozen", False)


@functools.cache
def field_types(section: type) -> dict[str, type]:
    """{field name: its value type} with Optional removed (list[int] stays list[int])."""
    out = {}
    for name, hint in typing.get_type_hints(section).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = type(None) in typing.get_args(hint) and len(args) == 1
        out[name] = args[0] if optional else hint
    return out


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
