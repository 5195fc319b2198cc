"""One layout the search tries, declared once: a frozen record whose fields are config field names.

Its command-line flags are spelled from the schema's declarations of those fields (the spellings,
actions and nargs megafab.arguments builds the parser from), and the search's configs are built
from the same values (Section.replaced on the base config), so the printed flags and the built
config read one declaration. A field is printed where its value differs from the schema's default;
None and False are the defaults of every field a candidate may leave unset. The flags the user gave
for these fields are removed first (strip_layout_flags), every spelling of them included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megafab.arguments import SPELLINGS, field_flags
from megafab.config.fields import field_default, field_types
from megafab.config.schema import SECTIONS, flag_fields


@dataclass(frozen=True)
class LayoutCandidate:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    num_virtual_stages_per_pipeline_rank: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: ETP = TP (megafab.layout)
    micro_batch_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    use_torch_fsdp2: bool = False
    overlap_param_gather: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None

    def values(self) -> dict:
        """{config field name: value}: what the search's config of this candidate is given."""
        return dict(vars(self))  # the fields, nothing else (no slots, no cached values)

    def replaced(self, **changes) -> LayoutCandidate:
        """dataclasses.replace(self, **changes) without __init__ (the search makes one per config
        it builds); the fields are plain values, nothing is derived from them at construction."""
        if not changes.keys() <= vars(self).keys():
            unknown = sorted(changes.keys() - vars(self).keys())
            raise TypeError(f"LayoutCandidate has no field {', '.join(unknown)}")
        copy = object.__new__(LayoutCandidate)
        vars(copy).update(vars(self), **changes)
        return copy

    def flags(self) -> list[str]:
        """The candidate on the command line, in declaration order (see the module docstring)."""
        out = []
        for name, spelled in SPELLED.items():
            out += spelled(name, getattr(self, name))
        return out


NAMES = tuple(f.name for f in dataclasses.fields(LayoutCandidate))
# Each candidate field's schema declaration (a KeyError here: the schema renamed a field).
_SCHEMA = {f.name: (section, f) for section, f in flag_fields()}
FIELDS = {name: _SCHEMA[name] for name in NAMES}

# The search's names for recompute and sharding settings, as candidate field values.
RECOMPUTE = {"none": {}, "selective": {"recompute_granularity": "selective"},
             "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                      "recompute_num_layers": 1}}
SHARDING = {"none": {}, "distributed_optimizer": {"use_distributed_optimizer": True},
            "fsdp2": {"use_torch_fsdp2": True}}


def _takes(f: dataclasses.Field, kind) -> int | str:
    """How many values a field's flag takes: 0 (a switch), 1, or "*" (nargs)."""
    if f.metadata["action"] or kind is bool:
        return 0
    return "*" if f.metadata["nargs"] in ("*", "+") else 1


@dataclass(frozen=True)
class _Spelling:
    """A candidate field's flag as the schema declares it."""
    default: object
    flag: str
    takes: int | str
    on: object = True  # the value a switch's flag gives
    negation: str | None = None

    def __call__(self, name: str, value) -> list[str]:
        if value == self.default:
            return []
        if self.takes == 0:
            if value == self.on:
                return [self.flag]
            if self.negation and value == (not self.on):
                return [self.negation]
        elif value is not None:
            return [self.flag, *map(str, value)] if self.takes == "*" else [self.flag, str(value)]
        raise ValueError(f"no flag sets {name} to {value!r} (its default is {self.default!r})")


def _spelling(section: str, f: dataclasses.Field) -> _Spelling:
    return _Spelling(field_default(f), field_flags(f)[0], _takes(f, field_types(SECTIONS[section])[f.name]),
                     f.metadata["action"] != "store_false", f.metadata["negation"])


SPELLED = {name: _spelling(*FIELDS[name]) for name in NAMES}


def _stripped() -> dict[str, int | str]:
    """Every spelling of a candidate field's flags, with how many values it takes."""
    out: dict[str, int | str] = {"--dry-run": 0}  # the search adds its own
    for name, (_, f) in FIELDS.items():
        out.update(dict.fromkeys(field_flags(f), SPELLED[name].takes))
        if f.metadata["negation"]:
            out[f.metadata["negation"]] = 0
        for flag, _, kwargs in SPELLINGS.get(name, ()):
            out[flag] = 1 if kwargs.get("action") == "store" else 0
    return out


LAYOUT_FLAGS = _stripped()


def strip_layout_flags(argv: list[str]) -> list[str]:
    """The user's flags without those a candidate sets."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name not in LAYOUT_FLAGS:
            out.append(token)
            i += 1
            continue
        i += 1
        if "=" in token or LAYOUT_FLAGS[name] == 0:
            continue
        if LAYOUT_FLAGS[name] == "*":
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
        else:
            i += 1
    return out
