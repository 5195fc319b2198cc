"""The one base class of megafab's user-facing errors, and the two that end a job on every rank.

A user mistake (a flag, a layout, a file, a dataset, a checkpoint, a conversion, a prompt) raises a
subclass of MegafabError whose message names the value or file, the rule and the fix. Entry points
run their body under megafab.run.report's `exit_on_user_error`: the message is printed once, by the
rank that should speak, and the process exits with the error's status (EXIT_USER_ERROR for a user
mistake, EXIT_JOB_FAULT for a job fault such as a dead rank) without a traceback. Anything else (an
internal bug) keeps its traceback.

Which rank speaks: an error every rank raises alike (a bad flag, a config rule, a file all ranks
read) is printed by rank 0 only; an error only some ranks see (a shard one rank reads, a rank's own
data) is raised with `every_rank=False` and printed by the rank that saw it. Once process groups
exist, megafab.run.faults makes sure one rank speaks for the whole job and marks the others' errors
`silent`.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2
EXIT_JOB_FAULT = 3


class MegafabError(ValueError):
    """A user-facing problem: the message says what is wrong, the rule, and how to fix it.

    every_rank: True when every rank of the job raises the same error (then only rank 0 prints it).
    silent: another rank has reported the job's error already; this rank exits without a word.
    """

    every_rank: bool = True
    exit_code: int = EXIT_USER_ERROR
    silent: bool = False

    def __init__(self, *args, every_rank: bool | None = None):
        super().__init__(*args)
        if every_rank is not None:
            self.every_rank = every_rank


class ReportedElsewhere(MegafabError):
    """This rank stops because another rank reported the job's error (printed there, not here)."""

    silent = True

    def __init__(self, reporter: int | None, message: str, exit_code: int = EXIT_USER_ERROR,
                 reported_at: float | None = None):
        who = f"rank {reporter}" if reporter is not None else "another rank"
        super().__init__(f"stopped because {who} reported: {message}")
        self.reporter = reporter
        self.exit_code = exit_code
        self.reported_at = reported_at


class JobFault(MegafabError):
    """The job cannot go on although the user's inputs are fine (a rank died or froze)."""

    exit_code = EXIT_JOB_FAULT
    every_rank = False
