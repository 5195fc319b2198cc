"""Run pretrain_gpt.py under torchrun from tests and read the Megatron log lines back."""

import os
import re
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSS_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], timeout: float = 300, cwd: str | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(ROOT, "pretrain_gpt.py"), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)


def losses(output: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in LOSS_LINE.finditer(output)}
