"""Every rule of a run in one home, each broken rule one line of one ConfigError: the config's
cross-field rules and the components' own `problems()` (rules.py, run_rules.py), and the start-up
probes of files and tokenizers on this machine (probes.py)."""

from __future__ import annotations

from megafab.checks import rules, run_rules
from megafab.config import Config, ConfigError


def problems(cfg: Config) -> list[str]:
    """Every rule `cfg` (resolved, see Config.resolve) breaks, one line each (pure: no file or machine
    probes)."""
    return (rules.choice_problems(cfg) + rules.model_problems(cfg) + rules.component_problems(cfg)
            + rules.parallel_problems(cfg) + rules.moe_problems(cfg) + rules.context_parallel_problems(cfg)
            + rules.precision_problems(cfg) + run_rules.training_problems(cfg) + run_rules.data_problems(cfg)
            + run_rules.checkpoint_problems(cfg) + run_rules.sharding_problems(cfg))


def model_layout_problems(cfg: Config) -> list[str]:
    """The rules a model at its parallel layout breaks, whatever the run around it: what a converted
    checkpoint records (megafab.convert checks every configuration it writes with these)."""
    return rules.model_problems(cfg) + rules.parallel_problems(cfg) + rules.moe_problems(cfg)


def validate(cfg: Config) -> None:
    found = problems(cfg)
    if found:
        raise ConfigError(found)


def finalize(cfg: Config, world_size: int) -> Config:
    """resolve, check everything at once (one ConfigError), freeze."""
    cfg.resolve(world_size)
    validate(cfg)
    return cfg.freeze()
