"""Run pretrain_gpt.py's main() as N ranks forked from the test process: the start-up (imports) is
paid once, and every case still gets fresh processes, real process groups and real exit codes.

    job = start_ranks(2, args, tmp_path)      # ranks rendezvous over TCP like torchrun's workers
    wait_for_text(job, 0, "iteration        3/")
    os.kill(job.pids[1], signal.SIGKILL)
    result = job.wait(timeout=60)             # result.codes, result.out[r], result.err[r], elapsed
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch._dynamo  # noqa: F401 - imported once here (torch.optim's first use takes seconds), DCP too,

import pretrain_gpt  # noqa: F401 - so that every forked rank starts warm
from megafab.checkpoint import dcp_io  # noqa: F401
from megafab.training import pretrain  # noqa: F401
from tests.helpers.launch import free_port


@dataclass
class RanksResult:
    codes: list[int | None]
    out: list[str]
    err: list[str]
    elapsed: list[float | None]
    """Seconds from the start to each rank's exit (None: still running at the timeout, killed)."""

    def all_err(self) -> str:
        return "".join(self.err)

    def describe(self) -> str:
        return "\n".join(f"--- rank {r} exit {c}\n{o[-1500:]}\n{e[-3000:]}"
                         for r, (c, o, e) in enumerate(zip(self.codes, self.out, self.err)))


@dataclass
class Ranks:
    pids: list[int]
    paths: list[tuple[str, str]]
    started: float
    codes: dict[int, int] = field(default_factory=dict)
    exited_at: dict[int, float] = field(default_factory=dict)

    def poll(self) -> None:
        for rank, pid in enumerate(self.pids):
            if rank in self.codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.codes[rank] = os.waitstatus_to_exitcode(status)
                self.exited_at[rank] = time.monotonic() - self.started

    def wait(self, timeout: float = 120, ranks=None) -> RanksResult:
        """Wait for every rank (or those in `ranks`) to exit, then kill the rest."""
        deadline = time.monotonic() + timeout
        ranks = set(range(len(self.pids)) if ranks is None else ranks)
        while not ranks <= set(self.codes) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.05)
        running = {r for r in range(len(self.pids)) if r not in self.codes}
        self.kill()
        read = [tuple(open(p, errors="replace").read() for p in pair) for pair in self.paths]
        return RanksResult([None if r in running else self.codes[r] for r in range(len(self.pids))],
                           [o for o, _ in read],
                           [e for _, e in read], [self.exited_at.get(r) for r in range(len(self.pids))])

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank still running (a failed test leaves no processes behind)."""
        self.poll()
        for rank, pid in enumerate(self.pids):
            if rank not in self.codes:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                self.codes[rank] = -signal.SIGKILL

    def output(self, rank: int) -> str:
        path = self.paths[rank][0]
        return open(path, errors="replace").read() if os.path.exists(path) else ""


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the test process dies first (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _rank_main(argv: list[str], env: dict[str, str], out_path: str, err_path: str, before_main) -> None:
    code = 1
    try:
        _die_with_parent()
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: where is it stuck?
        os.environ.update(env)
        for fd, path in ((1, out_path), (2, err_path)):
            f = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.dup2(f, fd)
            os.close(f)
        # pytest's capture replaced the Python-level streams; this rank writes to its own files.
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        import torch

        torch.set_num_threads(1)
        if before_main is not None:
            before_main(int(env["RANK"]))
        from pretrain_gpt import main

        code = main(argv) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - an internal error keeps its traceback, as in a real run
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start_ranks(nproc: int, argv: list[str], workdir, env: dict | None = None, before_main=None) -> Ranks:
    """before_main(rank), when given, runs in each rank before main() (e.g. to patch a constant)."""
    port = free_port()
    os.makedirs(workdir, exist_ok=True)
    pids, paths = [], []
    started = time.monotonic()
    for rank in range(nproc):
        out, err = os.path.join(workdir, f"rank{rank}.out"), os.path.join(workdir, f"rank{rank}.err")
        for path in (out, err):
            open(path, "w").close()
        rank_env = {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                    **(env or {})}
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _rank_main(list(map(str, argv)), rank_env, out, err, before_main)
        pids.append(pid)
        paths.append((out, err))
    return Ranks(pids, paths, started)


def run_ranks_main(nproc: int, argv: list[str], workdir, env: dict | None = None,
                   timeout: float = 120, before_main=None) -> RanksResult:
    return start_ranks(nproc, argv, workdir, env, before_main).wait(timeout)


def main_stdout(nproc: int, argv: list[str], workdir, timeout: float = 240) -> str:
    """What torchrun would print of pretrain_gpt.py's main() on `nproc` ranks (every rank's stdout,
    in rank order), each rank forked and working in `workdir`; asserts that every rank exits 0."""
    result = run_ranks_main(nproc, argv, workdir, timeout=timeout, before_main=lambda rank: os.chdir(workdir))
    assert result.codes == [0] * nproc, result.describe()
    return "".join(result.out)


def wait_for_text(job: Ranks, rank: int, text: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = job.output(rank)
        if text in out:
            return out
        job.poll()
        if rank in job.codes:
            raise AssertionError(f"rank {rank} exited ({job.codes[rank]}) before printing {text!r}")
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} printed no {text!r} within {timeout} s")
