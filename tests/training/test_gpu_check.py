"""benchmarks/gpu_check.py runs end to end in its --tiny CPU mode and writes its JSON."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_tiny_cpu_runs_and_reports(tmp_path):
    out = tmp_path / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--tiny",
                           "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=180,
                          env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokens/s" in proc.stdout and "TFLOP/s/GPU" in proc.stdout
    results = json.loads(out.read_text())
    local = results["local"]
    assert 4.0 < local["first_loss"] < 7.0  # about ln(256) for random tokens
    assert local["tokens_per_s"] > 0 and local["params"] > 0
    assert results["te"].startswith("skipped") or "first_loss" in results["te"]
