"""When one rank cannot go on, one rank speaks for the job and every other rank stops, quietly and soon.

    with FaultWatch.start() as watch:      # after init_process_group
        watch.where = "iteration 7"        # what the job is doing, for the report
        ...

Every rank keeps private connections to the job's rendezvous store and a watcher thread blocked on
one key, ABORT. The first rank that stops claims the report with an atomic counter, publishes it
and collects acknowledgements before it exits; every other rank's watcher wakes at once and
acknowledges, and its main thread exits without a word (or is ended by its watcher after GRACE_S
seconds if it is stuck). The ranks that never acknowledge are the unreachable ones the report
names. What stopped a rank is told by the exception's type and where it was raised, never by its
text (FaultWatch._settle): a user error (exit 2), a job fault (3), a SystemExit (its status) or
anything else (1).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

from megafab.errors import EXIT_JOB_FAULT, JobFault, MegafabError, ReportedElsewhere
from megafab.run.launch import agent_hosts_store, read_launch_env
from megafab.run.report import report
from megafab.run.signals import ignore_sigterm

ABORT = "megafab/abort"
CLAIMS = "megafab/claims"
ACKS = "megafab/acks"
ACK = "megafab/ack/"
REPORTED = "megafab/reported"
DONE = "megafab/done"
GRACE_S = 5.0
ACK_WINDOW_S = 3.0
FOREVER = datetime.timedelta(days=3650)
FINISH_WAIT_S = 60.0
DISTRIBUTED_DIR = os.sep + os.path.join("torch", "distributed") + os.sep


# ---- what failed ---------------------------------------------------------------------------------
def _frames(exc: BaseException):
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


class CollectiveFailure(RuntimeError):
    """An asynchronous collective failed while megafab waited on it (the backend's error is the
    cause). Its traceback starts in megafab, not in torch.distributed, hence its own type."""

    def __init__(self, collective: str, group, cause: BaseException):
        super().__init__(str(cause))
        self.collective, self.group = collective, group


def wait(work, collective: str, group=None) -> None:
    """work.wait() for an asynchronous collective (`collective`: its name, for the report)."""
    try:
        work.wait()
    except dist.DistError:
        raise
    except RuntimeError as error:
        raise CollectiveFailure(collective, group, error) from error


def is_collective_failure(exc: BaseException) -> bool:
    """By type (torch.distributed's errors, a failed wait) or origin (raised inside torch.distributed)."""
    if isinstance(exc, (dist.DistError, CollectiveFailure)):
        return True
    return isinstance(exc, RuntimeError) and any(DISTRIBUTED_DIR in f.f_code.co_filename
                                                 for f in _frames(exc))


def _group_ranks(group) -> list[int] | None:
    try:
        return dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
    except Exception:  # noqa: BLE001 - a broken group may not answer; the report does without
        return None


def describe_collective(exc: BaseException) -> tuple[str, list[int] | None]:
    """('all_reduce', [1, 3]): the torch.distributed call that failed and its group's ranks."""
    if isinstance(exc, CollectiveFailure):
        return f"an asynchronous {exc.collective}", None if exc.group is None else _group_ranks(exc.group)
    caller = None
    for frame in _frames(exc):
        path = frame.f_code.co_filename
        if DISTRIBUTED_DIR in path:
            if frame.f_code.co_name in ("wrapper", "_wrapper", "inner"):
                continue
            name = frame.f_code.co_name
            if "checkpoint" in path:
                name = f"torch.distributed.checkpoint {name}"
            where = f" (called from {caller})" if caller else ""
            return name + where, _group_ranks(frame.f_locals.get("group"))
        if os.sep + "megafab" + os.sep in path:
            caller = f"{path.split(os.sep + 'megafab' + os.sep)[-1]}:{frame.f_code.co_name}"
    return f"an asynchronous collective (waited on in {caller or 'megafab'})", None


def describe_reason(exc: BaseException, timeout_s: float | None) -> str:
    """The backend's reason in a few words (the backends say it only in their message's text)."""
    text = str(exc)
    if "imed out" in text or "timeout" in text.lower():
        limit = f" after {timeout_s:g} s (--distributed-timeout-minutes {timeout_s / 60:g})" \
            if timeout_s else ""
        return f"timed out{limit}"
    if "reset by peer" in text or "closed by peer" in text or "Connection closed" in text:
        return "a peer closed its connection"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:300]


# ---- the job-wide report -------------------------------------------------------------------------
class FaultWatch:
    """This rank's link to the job-wide report (see the module docstring); a context manager that
    turns whatever stops this rank into one report for the job, or into silence.

    A stopped rank's peers usually fail at once in a collective with it (gloo notices a closed
    connection); a main thread still stuck after grace_s (an NCCL collective never notices a
    departed peer, a rank that talks to nobody yet) is ended by its watcher with the reporter's
    exit status. The store is the job's rendezvous store: torchrun's agent hosts it, so it outlives
    any worker; without torchrun rank 0 hosts it, and a report then cannot be shared once rank 0
    is gone: each survivor prints its own."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float | None = None,
                 grace_s: float = GRACE_S, ack_window_s: float = ACK_WINDOW_S, hosts_store: bool = False,
                 store_address: tuple[str, int] | None = None):
        """store_address: where the store listens, probed before a failing rank talks to it (a
        request to a departed store makes c10d log a C++ stack trace)."""
        self.rank, self.world_size, self.hosts_store = rank, world_size, hosts_store
        self.store_address = store_address
        self.timeout_s, self.grace_s, self.ack_window_s = timeout_s, grace_s, ack_window_s
        self.where = "start-up"
        self.published: dict | None = None  # another rank's report, as the watcher read it
        self._acked = self._left = self._main_leaving = False
        # Set once the watcher is out of c10d's store calls for good: a thread still inside one when
        # the interpreter finalizes is torn down through C++ frames, and the process aborts.
        self._out_of_store = threading.Event()
        self._lock = threading.Lock()
        self._store = store.clone()
        self._watch_store = store.clone()
        self._thread = threading.Thread(target=self._watch, name="megafab-fault-watch", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, timeout_s: float | None = None, **kwargs) -> FaultWatch:
        """For the default process group, through the store it was initialized with; timeout_s:
        the process groups' timeout, for the report."""
        from torch.distributed.distributed_c10d import _get_default_store

        rank, launch = dist.get_rank(), read_launch_env()
        kwargs.setdefault("hosts_store", rank == 0 and not agent_hosts_store())
        kwargs.setdefault("store_address", (launch.master_addr, launch.master_port))
        return cls(_get_default_store(), rank, dist.get_world_size(), timeout_s, **kwargs)

    # ---- store traffic ------------------------------------------------------------------------
    def _store_reachable(self) -> bool:
        if self.store_address is None:
            return True
        try:
            socket.create_connection(self.store_address, timeout=1.0).close()
            return True
        except OSError:
            return False

    def _ack(self, store) -> None:
        with self._lock:
            if self._acked:
                return
            self._acked = True
        store.set(f"{ACK}{self.rank}", "1")
        store.add(ACKS, 1)

    def _published(self, wait_s: float = 0.0) -> dict | None:
        """The report another rank published (waiting up to wait_s for it), or None."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.published is not None:
                return self.published
            if self._store.check([ABORT]):
                return json.loads(self._store.get(ABORT))
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _claim(self) -> bool:
        return self._store.add(CLAIMS, 1) == 1

    def _publish(self, message: str, exit_code: int) -> None:
        value = {"rank": self.rank, "message": message, "exit_code": exit_code, "time": time.time()}
        self._store.set(ABORT, json.dumps(value))

    def _silent_ranks(self) -> list[int] | None:
        """The ranks that did not acknowledge the report within the window (None: no store)."""
        try:
            deadline = time.monotonic() + self.ack_window_s
            while time.monotonic() < deadline and self._store.add(ACKS, 0) < self.world_size:
                time.sleep(0.05)
            silent = [r for r in range(self.world_size) if not self._store.check([f"{ACK}{r}"])]
            self._store.set(REPORTED, json.dumps(silent))
            return silent
        except Exception:  # noqa: BLE001 - the store's host left
            return None

    def _leave(self, store) -> None:
        """This rank is done with the store; the store's host (rank 0 without torchrun) stays until
        every rank that can still answer is done too (bounded), so that none loses the store."""
        try:
            with self._lock:
                first, self._left = not self._left, True
            if first:
                store.add(DONE, 1)
            deadline = time.monotonic() + self.ack_window_s + self.grace_s + 2.0
            while self.hosts_store and time.monotonic() < deadline:
                if store.check([REPORTED]):
                    unreachable = json.loads(store.get(REPORTED))
                    if store.add(DONE, 0) >= self.world_size - len(unreachable):
                        return
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store's host left already
            pass

    # ---- the watcher thread -------------------------------------------------------------------
    def _watch(self) -> None:
        try:
            self._watch_store.wait([ABORT], FOREVER)
            published = json.loads(self._watch_store.get(ABORT))
            if published.get("finished") or published["rank"] == self.rank:
                return
            self.published = published
            self._ack(self._watch_store)
        except Exception:  # noqa: BLE001 - the store is gone: the job is over or its host died
            return
        finally:
            self._out_of_store.set()
        time.sleep(self.grace_s)
        if self._main_leaving:  # the main thread stopped by itself, and may be finalizing
            return
        # The main thread did not stop by itself: it is stuck, or has nothing to fail on yet.
        self._leave(self._watch_store)
        code = report(ReportedElsewhere(published["rank"], published["message"], published["exit_code"],
                                        published["time"]))
        sys.stdout.flush()
        os._exit(code)

    # ---- the context manager ------------------------------------------------------------------
    def __enter__(self) -> FaultWatch:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, KeyboardInterrupt):  # Ctrl-C reaches every rank itself
            return False
        # This process is leaving: torchrun's stop (SIGTERM to every worker once one has exited)
        # must not cut its report short, and torchrun's summary should show its own exit status.
        ignore_sigterm()
        self._main_leaving = True
        replacement = None
        if isinstance(exc, SystemExit):  # this rank's own exit (its words, if any, are printed)
            self._share_exit(exc)
        elif getattr(exc, "silent", False):  # another rank's report is on its way
            try:
                self._ack(self._store)
            except Exception:  # noqa: BLE001
                pass
        else:
            replacement = self._settle(exc)
        if self._store_reachable():
            self._leave(self._store)
            self._out_of_store.wait(self.ack_window_s)  # woken by the report, if one was published
        if replacement is not None:
            raise replacement from None
        return False

    def _settle(self, exc: BaseException) -> BaseException | None:
        """Who speaks for `exc`; returns the exception to raise instead, or None to re-raise it.

        - a MegafabError: a user error; its message from one rank, its status (2);
        - a job fault: torch.distributed's own errors (DistError: DistBackendError, DistStoreError,
          DistNetworkError), a CollectiveFailure (an asynchronous collective megafab waited on
          through `wait`), or a RuntimeError raised inside a torch.distributed call (gloo raises
          plain ones); the report names the collective, its group, what the job was doing and the
          ranks that did not answer; status 3;
        - a SystemExit: this rank's own status, which the other ranks then exit with;
        - anything else (a DataLoader worker that timed out or died, a bug): this rank's error; its
          traceback in this rank's log, status 1.
        """
        user_error = isinstance(exc, MegafabError)
        fault = not user_error and is_collective_failure(exc)
        try:
            if not self._store_reachable():
                raise ConnectionError("the rendezvous store is gone")
            self._ack(self._store)
            published = self._published()
            if published is not None:
                return ReportedElsewhere(published["rank"], published["message"], published["exit_code"],
                                         published["time"])
            if user_error and exc.every_rank and self.rank != 0:
                return None  # rank 0 raises it too and speaks (errors.should_print)
            if not self._claim():  # another rank is publishing its report right now
                published = self._published(wait_s=self.ack_window_s) or \
                    {"rank": None, "message": "see the first failing rank's message", "time": None,
                     "exit_code": EXIT_JOB_FAULT if fault else getattr(exc, "exit_code", 1)}
                return ReportedElsewhere(published["rank"], published["message"], published["exit_code"],
                                         published["time"])
        except Exception:  # noqa: BLE001 - no store: this rank speaks for itself
            return self._fault(exc, None) if fault else None
        if user_error:
            self._publish(str(exc), exc.exit_code)
            self._silent_ranks()  # the others have read the report before this rank (maybe the
            return None           # store's host) leaves
        if fault:
            summary = f"{describe_collective(exc)[0]} failed at {self.where}"
            self._publish(summary, EXIT_JOB_FAULT)
            return self._fault(exc, self._silent_ranks())
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        self._publish(f"rank {self.rank}: {type(exc).__name__} at {self.where}: {first} (its traceback is "
                      f"in rank {self.rank}'s log)", 1)
        self._silent_ranks()
        return None

    def _share_exit(self, stop: SystemExit) -> None:
        """A SystemExit ends the job with this rank's status, unless another rank reported first;
        without this the others would wait for this rank in their next collective."""
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        try:
            if not self._store_reachable():
                return
            self._ack(self._store)
            if self._published() is None and self._claim():
                self._publish(f"rank {self.rank} exited with status {code} at {self.where}", code)
                self._silent_ranks()
        except Exception:  # noqa: BLE001 - no store: the others find out in their next collective
            pass

    def _fault(self, exc: BaseException, silent: list[int] | None) -> JobFault:
        collective, group = describe_collective(exc)
        over = f" over ranks {group}" if group else ""
        text = (f"rank {self.rank}: {collective}{over} failed at {self.where}: "
                f"{describe_reason(exc, self.timeout_s)}; ")
        if silent is None:
            text += ("the job's rendezvous store does not answer either (without torchrun rank 0 hosts "
                     "it), so rank 0 is probably gone")
        elif silent:
            lost = [r for r in silent if group is None or r in group] or silent
            text += (f"rank(s) {lost} did not answer within {self.ack_window_s:g} s: killed, frozen "
                     f"or on a host that went down (see their logs; torchrun's summary names the signal "
                     f"of a killed rank)")
        else:
            text += "every rank still answers, so the network or the backend failed: " + \
                str(exc).strip().splitlines()[0][:300]
        return JobFault(text + ". Restart the job to resume from the last checkpoint (--load; under "
                               "torchrun --max-restarts it resumes by itself)")

    def close(self) -> None:
        """After the job's last collective: release every rank's watcher (rank 0 says so)."""
        if self.rank == 0:
            try:
                self._store.set(ABORT, json.dumps({"finished": True}))
            except Exception:  # noqa: BLE001
                pass
        self._out_of_store.wait(FINISH_WAIT_S)

