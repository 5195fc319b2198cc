"""The one base class of megafab's user-facing errors, and the one place entry points catch it.

A user mistake (a flag, a layout, a file, a dataset, a checkpoint, a conversion, a prompt) raises a
subclass of MegafabError whose message names the value or file, the rule and the fix. Entry points
run their body under `exit_on_user_error`: the message is printed once, as `megafab: error: ...`,
by the rank that should speak, and the process exits with status 2 without a traceback. Anything
else (an internal bug) keeps its traceback.

Which rank speaks: an error every rank raises alike (a bad flag, a config rule, a file all ranks
read) is printed by rank 0 only; an error only some ranks see (a shard one rank reads, a rank's own
data) is raised with `every_rank=False` and printed by the rank that saw it.
"""

from __future__ import annotations

import contextlib
import os
import sys

EXIT_USER_ERROR = 2


class MegafabError(ValueError):
    """A user-facing problem: the message says what is wrong, the rule, and how to fix it.

    every_rank: True when every rank of the job raises the same error (then only rank 0 prints it).
    """

    every_rank: bool = True

    def __init__(self, *args, every_rank: bool | None = None):
        super().__init__(*args)
        if every_rank is not None:
            self.every_rank = every_rank


def process_rank() -> int:
    """This process's global rank from the launcher's environment (0 when launched alone)."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def should_print(error: MegafabError, rank: int | None = None) -> bool:
    rank = process_rank() if rank is None else rank
    return rank == 0 or not getattr(error, "every_rank", True)


def format_error(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text if text.startswith("megafab: error:") else f"megafab: error: {text}"


@contextlib.contextmanager
def exit_on_user_error(rank: int | None = None):
    """Run an entry point's body: a MegafabError becomes one message and exit status 2."""
    try:
        yield
    except MegafabError as error:
        if should_print(error, rank):
            print(format_error(error), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
