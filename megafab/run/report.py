"""The one error reporter: a MegafabError becomes one message from one rank and an exit status.

    with exit_on_user_error():     # an entry point's body
        ...

The rank that speaks (errors.py says which) prints `megafab: error: ...` once and, under torchrun,
is the only writer of torch elastic's error file (TORCHELASTIC_ERROR_FILE), so that torchrun's
failure summary names that message as the root cause and nowhere else. The other ranks exit with the
same status and write nothing: torchrun lists them as plain exit codes. The speaker's file is
stamped a second early, because torchrun stamps a rank without a file when it collects it (maybe
within the same second) and picks the earliest stamp as the root cause.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from megafab.errors import EXIT_USER_ERROR, MegafabError
from megafab.run.launch import process_rank
from megafab.run.signals import ignore_sigterm

ELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
SILENT_EXIT_DELAY_S = 1.0


def should_print(error: MegafabError, rank: int | None = None) -> bool:
    if getattr(error, "silent", False):
        return False
    rank = process_rank() if rank is None else rank
    return rank == 0 or not getattr(error, "every_rank", True)


def format_error(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text if text.startswith("megafab: error:") else f"megafab: error: {text}"


def write_elastic_error_file(message: str) -> None:
    """torch elastic's error-file format, with the message where torchrun shows a traceback."""
    path = os.environ.get(ELASTIC_ERROR_FILE)
    if not path:
        return
    stamp = str(int(time.time()) - 1)  # earlier than any rank torchrun stamps itself (module docstring)
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": stamp}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then lacks our message; never hide the real error behind this one


def report(error: MegafabError, rank: int | None = None) -> int:
    """Print and record `error` if this rank speaks; returns the exit status."""
    if should_print(error, rank):
        text = format_error(error)
        print(text, file=sys.stderr, flush=True)
        write_elastic_error_file(text)
    elif os.environ.get(ELASTIC_ERROR_FILE):
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
        ignore_sigterm()  # leaving anyway: finish the report first
        raise SystemExit(report(error, rank)) from None


def exit_status(body, rank: int | None = None) -> int:
    """body() under exit_on_user_error, as the status a `sys.exit(main())` tool returns."""
    try:
        with exit_on_user_error(rank):
            return body() or 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
