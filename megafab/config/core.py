"""The whole configuration of a run: its sections, built from flags, derived, frozen (the rules
that check it are megafab.checks', above the engine).

    Config.from_flat(values)      sections from a flat {field name: value} mapping
    cfg.resolve(world_size)       Megatron's derivations (config/derive.py), still writable
    cfg.freeze()                  no field can be assigned any more
    cfg.finalize(world_size)      resolve, then freeze (megafab.checks.finalize validates between)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megafab.config.derive import derive
from megafab.config.schema import (
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    Section,
    TrainingConfig,
)
from megafab.errors import MegafabError


class ConfigError(MegafabError):
    """Every problem found in a configuration, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the configuration:\n{lines}")


@dataclass
class Config(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    notes: list[str] = field(default_factory=list)
    """Adjustments made while finalizing (e.g. sequence parallel turned off at TP 1)."""
    no_effect: list[str] = field(default_factory=list)
    """Flags accepted that change nothing here, each "--flag (why)"; printed once at start-up."""

    @classmethod
    def from_flat(cls, values: dict) -> Config:
        """Build from a flat {field_name: value} mapping such as vars(argparse.Namespace)."""
        sections = {}
        for name, section_cls in SECTIONS.items():
            names = {f.name for f in dataclasses.fields(section_cls)}
            sections[name] = section_cls(**{k: v for k, v in values.items() if k in names})
        return cls(**sections)

    def to_flat(self) -> dict:
        flat = {}
        for name in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat

    def resolve(self, world_size: int) -> Config:
        """Fill the derived values as Megatron does (config/derive.py); the config stays writable."""
        self.notes, self.no_effect = list(self.notes), list(self.no_effect)
        derive(self, world_size)
        return self

    def finalize(self, world_size: int) -> Config:
        """resolve, then freeze; the rules are megafab.checks' (checks.finalize validates too)."""
        self.resolve(world_size)
        return self.freeze()

    def freeze(self) -> Config:
        """After this, assigning any field of any section raises FrozenInstanceError."""
        self.notes, self.no_effect = tuple(self.notes), tuple(self.no_effect)
        for name in SECTIONS:
            getattr(self, name).freeze()
        super().freeze()
        return self

    def start_up_notes(self) -> list[str]:
        """What rank 0 prints once at start-up: adjustments, then every flag that has no effect."""
        lines = list(self.notes)
        if self.no_effect:
            lines.append("accepted, no effect in megafab: " + "; ".join(self.no_effect))
        return lines
