"""Optional packages that flags ask for, checked at start-up on every rank.

A flag that needs a package megafab does not depend on (TensorBoard for --tensorboard-dir, ...) is
a machine check: every rank imports the package before any process group, model or dataset
exists, and a missing one is a problem in the entry point's one message (flag, package, install
command), exit 2, from one rank. The code that uses the package imports it through
`import_optional`, which raises the same message, so that a run started without the entry point's
checks still stops on one message rather than a traceback.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from megafab.errors import MegafabError


@dataclass(frozen=True)
class OptionalPackage:
    module: str  # what is imported
    extra: str  # pip install megafab[extra]


PACKAGES = {
    "tensorboard": OptionalPackage("tensorboard", "tensorboard"),
    "wandb": OptionalPackage("wandb", "wandb"),
    "tiktoken": OptionalPackage("tiktoken", "tiktoken"),
    "transformers": OptionalPackage("transformers", "hf"),
}


class MissingPackage(MegafabError):
    """A flag asks for an optional package this machine lacks."""


def missing_package_message(flag: str, package: str, error: BaseException | None = None) -> str:
    why = f" ({error})" if error is not None and str(error) else ""
    return (f"{flag} needs the {package} package, which cannot be imported here{why}; install it: "
            f"pip install megafab[{PACKAGES[package].extra}] (or pip install {package})")


def import_optional(package: str, flag: str):
    """The package's module, or MissingPackage naming `flag` (the one that needs it)."""
    try:
        return importlib.import_module(PACKAGES[package].module)
    except ImportError as error:
        raise MissingPackage(missing_package_message(flag, package, error), every_rank=False) from None


def packages_needed(cfg) -> list[tuple[str, str]]:
    """(flag, package) for every optional package the resolved config's flags need."""
    lg, data = cfg.logging, cfg.data
    needed = []
    if lg.tensorboard_dir:
        needed.append(("--tensorboard-dir", "tensorboard"))
    if lg.wandb_project:
        needed.append(("--wandb-project", "wandb"))
    if data.tokenizer_type == "TikTokenizer":
        needed.append(("--tokenizer-type TikTokenizer", "tiktoken"))
    if data.tokenizer_type == "HuggingFaceTokenizer" and data.tokenizer_model and \
            os.path.isdir(data.tokenizer_model):
        needed.append(("--tokenizer-type HuggingFaceTokenizer with a --tokenizer-model directory",
                       "transformers"))
    return needed


def missing_package_problems(cfg) -> list[str]:
    """A machine check: one problem per flag whose package this machine cannot import."""
    problems = []
    for flag, package in packages_needed(cfg):
        try:
            import_optional(package, flag)
        except MissingPackage as missing:
            problems.append(str(missing))
    return problems
