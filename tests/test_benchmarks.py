"""Each benchmark script runs with its smallest flags, exits 0 and prints its table (no timings
are asserted: benchmarks measure, tests do not)."""

import subprocess
import sys

import pytest

from tests.helpers.benchmarks import ROOT, TINY_BENCH, run_script
from tests.helpers.launch import free_port


@pytest.mark.timeout(300)
def test_step_throughput_prints_every_implementation_and_precision():
    out = run_script("step_throughput.py", *TINY_BENCH, "--batch", "2", "--steps", "1", "--rounds", "2",
                     "--warmup", "1")
    assert "tokens/s med [min-max]" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("fp32", "bf16"))]
    names = {(row[0], row[-5]) for row in rows}
    for precision in ("fp32", "bf16"):
        for impl in ("megafab", "torch", "hf"):
            assert (precision, impl) in names, out
    torch_rows = [row for row in rows if row[-5] == "torch"]
    assert all(row[-2] == "1.00" for row in torch_rows), out  # the baseline's ratio to itself


@pytest.mark.timeout(300)
def test_scaling_prints_an_efficiency_per_layout():
    out = run_script("scaling.py", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16",
                     "--vocab", "128", "--batch", "4", "--steps", "1", "--warmup", "1", "--rounds", "1")
    assert "efficiency" in out
    for layout in ("TP2", "DP2", "PP2"):
        row = next(line for line in out.splitlines() if line.startswith(layout))
        assert float(row.split()[-3]) > 0, row  # efficiency median (then [min-max], 2t speedup)


@pytest.mark.timeout(300)
def test_memory_prints_measured_and_planned_bytes():
    out = run_script("memory.py", *TINY_BENCH, "--batch", "2")
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines() if line.startswith("DP")}
    assert {"DP1", "DP2", "DP4", "DP4 dist-opt", "DP2 recompute", "DP2 dist-opt recompute"} <= set(rows), out
    # the distributed optimizer divides the optimizer state by DP on each rank
    assert float(rows["DP4 dist-opt"][2]) < float(rows["DP2 dist-opt"][2]) < float(rows["DP1"][2]), out
    # the distributed optimizer halves the optimizer state on each of the 2 ranks
    assert float(rows["DP2 dist-opt"][2]) < float(rows["DP2"][2]), out


@pytest.mark.timeout(300)
def test_data_throughput_prints_its_three_tables():
    out = run_script("data_throughput.py", "--index-tokens", "1000000", "--seq", "128", "--loader-samples",
                     "64", "--rounds", "1", "--max-docs", "20")
    assert "preprocess_data.py" in out and "GPTDataset index build" in out and "Data loader" in out
    worker_rows = [line.split()[0] for line in out.splitlines()
                   if line[:1].isdigit() and len(line.split()) >= 3]
    assert {"1", "2", "0"} <= set(worker_rows), out


@pytest.mark.timeout(300)
def test_gpu_tp_check_runs_on_cpu_and_checks_parity_and_saved_bytes():
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                             "benchmarks/gpu_tp_check.py", "--device", "cpu", "--tiny"],
                            cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "-> ok" in result.stdout.split("parity")[1].splitlines()[0], result.stdout
    assert "-> ok" in result.stdout.split("memory")[1].splitlines()[0], result.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_memory_prints_its_rows(tmp_path):
    out = run_script("checkpoint_memory.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16",
                     "--vocab", "128", "--iters", "2", "--bucket", "100", "--dp", "2", "--dp-sizes", "2",
                     "--data-cache-path", str(tmp_path / "data_cache"), timeout=540)
    rows = {line[:18].strip(): line[18:].split() for line in out.splitlines()
            if line.startswith(("no saves", "save every", "load +"))}
    assert set(rows) == {"no saves", "save every iter", "load + continue"}, out
    assert all(row[-1] == "yes" for row in rows.values()), out  # same losses as the run without saves
    assert any(line.startswith("2 ") for line in out.splitlines()), out  # the DP 2 save-time row


@pytest.mark.timeout(300)
def test_context_parallel_prints_memory_per_layout_and_cp2_efficiency():
    out = run_script("context_parallel.py", "--layers", "1", "--hidden", "32", "--heads", "4", "--seq", "64",
                     "--vocab", "128", "--speed-layers", "1", "--speed-hidden", "32", "--speed-heads", "4",
                     "--speed-seq", "32", "--speed-batch", "2", "--steps", "1", "--rounds", "1",
                     "--comm-types", "p2p")
    memory, speed = out.split("CP 2 step time")
    rows = {line[:16].strip(): line[16:].split() for line in memory.splitlines() if line.startswith("CP")}
    assert {"CP1", "CP2 p2p", "CP4 a2a"} <= set(rows), out
    assert float(rows["CP2 p2p"][0]) < float(rows["CP1"][0]), out  # CP 2 saves less per rank
    row = next(line for line in speed.splitlines() if line.startswith("CP2 p2p"))
    assert float(row.split()[-2]) > 0, out  # efficiency median


@pytest.mark.timeout(300)
def test_moe_prints_speed_parts_ep_efficiency_and_expert_bytes():
    out = run_script("moe.py", *TINY_BENCH, "--batch", "2", "--steps", "1", "--warmup", "1", "--rounds", "1",
                     "--part-reps", "1", "--layouts", "alltoall", "--memory-worlds", "1,2")
    rows = {line[:18].strip(): line[18:].split() for line in out.splitlines() if line.startswith("EP")}
    assert {"EP1", "EP2", "EP2 alltoall"} <= set(rows), out
    assert float(rows["EP2"][5]) < float(rows["EP1"][5]), out  # expert bytes per rank shrink with EP
    assert rows["EP2"][7] == "1.000" and rows["EP1"][7] == "1.000", out  # measured = the planner's
    assert float(rows["EP2 alltoall"][-4]) > 0, out  # efficiency median (then [min-max], vs 1t/2)
    speed = {line[:14].strip(): line[14:].split() for line in out.splitlines()
             if line.startswith(("dense ", "MoE "))}
    assert speed["dense"][2] == "1.00" and float(speed["MoE"][2]) > 0, out  # vs dense, wall
    assert "MoE: dispatch + combine" in out and "MoE grouped: experts" in out, out


@pytest.mark.timeout(300)
def test_recompute_modules_prints_saved_and_planned_bytes_per_module():
    out = run_script("recompute_modules.py", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16",
                     "--vocab", "128", "--rounds", "1", "--warmup", "0")
    rows = {line[:22].strip(): line[22:].split() for line in out.splitlines()
            if line[:22].strip() in ("none", "moe", "all")}
    assert set(rows) == {"none", "moe", "all"}, out
    assert float(rows["all"][0]) < float(rows["moe"][0]) < float(rows["none"][0]), out  # saved KiB


@pytest.mark.timeout(300)
def test_checkpoint_speed_prints_the_stall_of_sync_and_async_saves():
    out = run_script("checkpoint_speed.py", *TINY_BENCH, "--iters", "4")
    rows = {line.split()[1]: line.split() for line in out.splitlines()
            if line.split()[1:2] in (["sync"], ["async"])}
    assert set(rows) == {"sync", "async"}, out
    assert rows["sync"][2] == rows["async"][2] == "2", out  # two saves each
    assert float(rows["sync"][3]) > 0 and float(rows["async"][3]) > 0, out
    assert "async stall / sync stall, all saves with the end-of-training wait: median" in out
    assert "the saves after the first: median" in out


@pytest.mark.timeout(300)
def test_mtp_prints_the_cost_per_depth():
    out = run_script("mtp.py", *TINY_BENCH, "--rounds", "1")
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:1] in (["0"], ["1"], ["2"])}
    assert set(rows) == {"0", "1", "2"}, out
    saved = [float(rows[d][2]) for d in ("0", "1", "2")]
    assert saved[0] < saved[1] < saved[2], out  # each depth keeps more for backward
    assert rows["1"][-1] == rows["2"][-1] and float(rows["1"][-1].rstrip("%")) > 0, out  # FLOPs per depth


@pytest.mark.timeout(300)
def test_mla_prints_the_megatron_core_ratio_and_measured_next_to_planned_bytes():
    out = run_script("mla.py", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2",
                     "--rounds", "1", "--warmup", "0")
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines()
            if line[:24].strip() in ("none", "core_attn", "mla_up_proj", "core_attn mla_up_proj")}
    assert len(rows) == 4, out
    measured = {name: float(row[0]) for name, row in rows.items()}
    assert measured["core_attn mla_up_proj"] < min(measured["core_attn"], measured["mla_up_proj"]), out
    assert max(measured["core_attn"], measured["mla_up_proj"]) < measured["none"], out
    assert all(abs(float(row[2]) - 1) <= 0.05 for row in rows.values()), out  # planned / measured
    ratio = next(line for line in out.splitlines() if line.startswith("ratio megatron-core / megafab"))
    assert float(ratio.split(": ")[1].split("x")[0]) > 0, out
    differ = out.split("outputs differ by ")[1].split(";")[0]
    assert float(differ) < 1e-4, out  # the same weights: the same layer
