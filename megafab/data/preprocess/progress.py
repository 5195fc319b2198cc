"""Progress of a long step: a tqdm bar (total, rate, ETA) on a terminal, nothing when stderr is not one."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int | None, desc: str, unit: str = "B", enabled: bool | None = None):
        enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(
                total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, file=sys.stderr
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
