"""Run a benchmarks/ script at its smallest flags and return what it printed."""

import os
import subprocess
import sys

from tests.helpers.flags import TINY_GPT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The benchmark scripts' own flags for a GPT of the tiny sizes' hidden and sequence length.
TINY_BENCH = ["--layers", "1", "--hidden", str(TINY_GPT["hidden_size"]), "--heads", "2", "--seq",
              str(TINY_GPT["seq_length"]), "--vocab", "128"]


def run_script(name: str, *flags: str, timeout: float = 240) -> str:
    result = subprocess.run([sys.executable, f"benchmarks/{name}", *flags], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout
