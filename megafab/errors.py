"""The one base class of megafab's user-facing errors, and the one place entry points catch it.

A user mistake (a flag, a layout, a file, a dataset, a checkpoint, a conversion, a prompt) raises a
subclass of MegafabError whose message names the value or file, the rule and the fix. Entry points
run their body under `exit_on_user_error`: the message is printed once, as `megafab: error: ...`,
by the rank that should speak, and the process exits with the error's status (2 for a user
mistake, 3 for a job fault such as a dead rank) without a traceback. Anything else (an internal
bug) keeps its traceback.

Which rank speaks: an error every rank raises alike (a bad flag, a config rule, a file all ranks
read) is printed by rank 0 only; an error only some ranks see (a shard one rank reads, a rank's own
data) is raised with `every_rank=False` and printed by the rank that saw it. Once process groups
exist, megafab.distributed.faults makes sure one rank speaks for the whole job and marks the
others' errors `silent`.

Under torchrun the speaking rank also writes torch elastic's error file (TORCHELASTIC_ERROR_FILE),
so torchrun's failure summary names that message as the root cause; silent ranks write theirs one
second later, so they are never chosen as the first failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time

EXIT_USER_ERROR = 2
EXIT_JOB_FAULT = 3
ELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
SILENT_EXIT_DELAY_S = 1.0


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


def process_rank() -> int:
    """This process's global rank from the launcher's environment (0 when launched alone)."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def should_print(error: MegafabError, rank: int | None = None) -> bool:
    if getattr(error, "silent", False):
        return False
    rank = process_rank() if rank is None else rank
    return rank == 0 or not getattr(error, "every_rank", True)


def format_error(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text if text.startswith("megafab: error:") else f"megafab: error: {text}"


def write_elastic_error_file(message: str, timestamp: float | None = None) -> None:
    """torch elastic's error-file format, with the message where torchrun shows a traceback."""
    path = os.environ.get(ELASTIC_ERROR_FILE)
    if not path:
        return
    stamp = str(int(time.time() if timestamp is None else timestamp))
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": stamp}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then lacks our message; never hide the real error behind this one


def report(error: MegafabError, rank: int | None = None) -> int:
    """Print (if this rank speaks) and record `error`; returns the exit status."""
    text = format_error(error)
    if should_print(error, rank):
        print(text, file=sys.stderr, flush=True)
        write_elastic_error_file(text)
    else:
        # One second later than the speaker, so torchrun picks the speaker as the root cause.
        at = getattr(error, "reported_at", None)
        write_elastic_error_file(text, (at or time.time()) + 1)
        if os.environ.get(ELASTIC_ERROR_FILE):
            # torchrun stops every worker once one has exited: give the speaker time to speak.
            time.sleep(SILENT_EXIT_DELAY_S)
    return getattr(error, "exit_code", EXIT_USER_ERROR)


@contextlib.contextmanager
def exit_on_user_error(rank: int | None = None):
    """Run an entry point's body: a MegafabError becomes one message and its exit status."""
    try:
        yield
    except MegafabError as error:
        sys.stdout.flush()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving anyway: finish the report first
        raise SystemExit(report(error, rank)) from None


def exit_status(body, rank: int | None = None) -> int:
    """body() under exit_on_user_error, as the status a `sys.exit(main())` tool returns."""
    try:
        with exit_on_user_error(rank):
            return body() or 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
