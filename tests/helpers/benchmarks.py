"""Run a benchmarks/ script at its smallest flags and return what it printed."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_GPT = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "128"]


def run_script(name: str, *flags: str, timeout: float = 240) -> str:
    result = subprocess.run([sys.executable, f"benchmarks/{name}", *flags], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout
