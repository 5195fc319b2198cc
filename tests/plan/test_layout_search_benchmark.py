"""benchmarks/layout_search.py runs at its smallest size and prints its table (no timings asserted)."""

import dataclasses
import os
import subprocess
import sys

import pytest

from megafab.plan.machines import BUILTIN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_layout_search_benchmark_prints_predicted_and_measured(tmp_path):
    profile = tmp_path / "machine.json"
    # any profile: the script's plumbing is under test; one calibration row to re-launch per round
    row = {"world": 2, "group": 2, "ops": ["all_reduce"], "term": "step_alpha", "flags": [], "step_s": 0.01}
    dataclasses.replace(BUILTIN["h100-sxm-80gb"], calibration_steps=[row]).save(str(profile))
    result = subprocess.run(
        [sys.executable, "benchmarks/layout_search.py", "--machine", str(profile), "--worlds", "2",
         "--micro-batches", "1", "--recompute", "none", "--sharding", "none", "--layers", "2",
         "--hidden", "32",
         "--heads", "2", "--seq", "16", "--vocab", "128", "--batch", "4", "--iters", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("TP")]
    assert {row.split()[0] + " " + row.split()[1] for row in rows} == {"TP1 PP1", "TP1 PP2", "TP2 PP1"}
    assert "Spearman" in result.stdout and "median |predicted/measured - 1|" in result.stdout
    drift = next(line for line in result.stdout.splitlines() if "over their time at the profile" in line)
    assert float(drift.split()[-1].rstrip("x")) > 0
    assert "the machine's drift taken out" in result.stdout
