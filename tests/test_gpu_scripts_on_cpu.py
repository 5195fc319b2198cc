"""The issue-26 device scripts' CPU-safe parts: the CP check's ring emulation (fused CPU kernel and
the reference against one process) and sync check, the FP8 curve's local row, the overlap trace
analysis on a made-up trace, and the shell script's syntax."""

import json
import subprocess

import pytest

from benchmarks.gpu_overlap_trace import overlap_of
from tests.helpers.benchmarks import ROOT, run_script


@pytest.mark.timeout(300)
def test_gpu_cp_check_passes_on_cpu():
    out = run_script("gpu_cp_check.py", "--device", "cpu", "--dtype", "fp32", "--seq", "128", "--heads", "4",
                     "--groups", "2", "--dim", "16", "--parity-seq", "64", "--repeats", "1")
    assert "fused kernel CpuFlashKernel" in out
    for cp in (2, 4):
        for implementation in ("auto", "reference"):
            assert f"parity CP {cp} {implementation}" in out
    assert "sync check p2p: no sync" in out and "sync check allgather: no sync" in out
    assert out.rstrip().endswith("gpu_cp_check: PASS")


@pytest.mark.timeout(300)
def test_gpu_fp8_curve_runs_the_local_row_on_cpu(tmp_path):
    out = run_script("gpu_fp8_curve.py", "--tiny", "--device", "cpu", "--steps", "2", "--every", "1",
                     "--out", str(tmp_path / "curve.json"))
    result = json.loads((tmp_path / "curve.json").read_text())
    assert len(result["local_bf16"]) == 2 and result["te_fp8"].startswith("skipped")
    assert "te_fp8: skipped" in out


def test_overlap_analysis_measures_gather_time_concurrent_with_compute(tmp_path):
    kernels = [("ncclDevKernel_AllGather_RING", 0, 100), ("sm90_gemm", 50, 100),
               ("ncclDevKernel_AllGather", 300, 50), ("ncclDevKernel_ReduceScatter", 120, 100),
               ("elementwise", 500, 10)]
    trace = {"traceEvents": [{"cat": "kernel", "name": n, "ts": ts, "dur": d} for n, ts, d in kernels]
             + [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    result = overlap_of(str(path))
    assert result["all_gather_kernels"] == 2 and result["all_gather_us"] == 150
    assert result["overlapped_us"] == 50 and abs(result["overlapped_share"] - 1 / 3) < 1e-12
    assert result["first_gather_end_minus_first_compute_us"] == 50


def test_device_script_parses():
    subprocess.run(["bash", "-n", "benchmarks/gpu_device_check.sh"], cwd=ROOT, check=True)
