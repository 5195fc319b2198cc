"""Run pretrain_gpt.py under torchrun from tests and read the Megatron log lines back."""

import os
import re
import subprocess
import sys

from megafab.run.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSS_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")


def torchrun(nproc: int, args: list[str], timeout: float = 300, cwd: str | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(ROOT, "pretrain_gpt.py"), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)


def losses(output: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in LOSS_LINE.finditer(output)}


def _pretrain_captured(rank, world, flags):
    import contextlib
    import io

    from megafab.arguments import config_from_args
    from megafab.training.pretrain import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(config_from_args(flags, world_size=world, start_up=True))
    return out.getvalue()


def pretrain_in_ranks(flags: list[str], world_size: int, timeout: float = 240) -> list[str]:
    """pretrain() on forked gloo ranks (megafab/run/fork_ranks.py, far cheaper than torchrun); each
    rank's stdout."""
    from megafab.run.fork_ranks import run_ranks

    return run_ranks(_pretrain_captured, world_size, flags, timeout=timeout)
