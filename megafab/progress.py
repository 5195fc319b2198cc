"""Progress of a long step: a tqdm bar (total, rate, ETA) on a terminal, nothing when stderr is not one
(and, in a multi-process job, only on rank 0). A tool whose phases belong in its log (megafab-convert's
reading / writing) asks for `announce`: off a terminal each phase is then one plain line, never a bar
(no carriage returns in log files)."""

from __future__ import annotations

import sys

from megafab.run.launch import process_rank


class Progress:
    """unit "B" scales bytes (kB, MB, ...); any other unit counts items."""

    def __init__(self, total: int | None, desc: str, unit: str = "B", enabled: bool | None = None):
        enabled = on_terminal() if enabled is None else enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(
                total=total, desc=desc, unit=unit, unit_scale=unit == "B", dynamic_ncols=True, file=sys.stderr
            )

    def update(self, amount: int, **postfix) -> None:
        if self._bar is not None:
            self._bar.update(amount)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def write(self, message: str) -> None:
        """A log line that does not break the bar."""
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def on_terminal() -> bool:
    """Whether this process shows bars: stderr is a terminal, and this is rank 0."""
    return sys.stderr.isatty() and process_rank() == 0


def progress(iterable, total: int | None = None, desc: str = "", unit: str = "it",
             enabled: bool | None = None, announce: bool = False):
    """Yield from iterable with a Progress bar of `total` steps (len(iterable) when it has one).
    The hook long loops call (conversion, checkpoint load/save, index builds); quiet off a terminal,
    where `announce` prints `desc` once as a log line instead."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    enabled = on_terminal() if enabled is None else enabled
    if announce and not enabled and process_rank() == 0:
        print(f"{desc} ({total} {unit})" if total is not None else desc, file=sys.stderr, flush=True)
    bar = Progress(total, desc, unit=unit, enabled=enabled)
    try:
        for item in iterable:
            yield item
            bar.update(1)
    finally:
        bar.close()
