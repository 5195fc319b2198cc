"""The one owner of SIGTERM in a megafab process (nothing else in megafab calls signal.signal).

Two uses: --exit-signal-handler records the signal so that the training loop saves and stops at
the next iteration every rank agrees on (SigtermFlag); a process that is already leaving ignores it
(torchrun sends SIGTERM to every worker once one has exited, which must not cut a report short), as
does an --async-save writer process, which its rank stops.
"""

from __future__ import annotations

import signal
import threading


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # signal.signal works there only


def ignore_sigterm(interrupt: bool = False) -> None:
    """This process is leaving: a SIGTERM from now on must not interrupt its last words. interrupt:
    SIGINT too (a checkpoint writer process, which its rank stops when it decides)."""
    if _in_main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT) if interrupt else (signal.SIGTERM,):
            signal.signal(sig, signal.SIG_IGN)


class SigtermFlag:
    """--exit-signal-handler: SIGTERM sets `received` instead of ending the process."""

    def __init__(self, enabled: bool):
        self.received = False
        if enabled and _in_main_thread():
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank(self, device) -> bool:
        """Collective: whether any rank received SIGTERM."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0
