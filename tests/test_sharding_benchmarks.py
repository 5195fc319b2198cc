"""benchmarks/memory.py --sharding and benchmarks/fsdp_throughput.py at their smallest sizes: the
ZeRO-3 bytes per parameter per rank are within 10% of 16/d and of the planner at DP 1/2/4, the
offloaded runs' device bytes within 10% of the planner's (bytes are measured, not timed); the
throughput script prints a ratio per round."""

import pytest

from tests.helpers.benchmarks import TINY_BENCH, run_script


@pytest.mark.timeout(600)
def test_memory_sharding_rows_are_zero3_and_match_the_planner():
    out = run_script("memory.py", *TINY_BENCH, "--batch", "1", "--sharding", timeout=540)
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines()
            if line.startswith(("FSDP2", "DP2 dist-opt"))}
    assert set(rows) == {"FSDP2 DP1", "FSDP2 DP2", "FSDP2 DP4", "FSDP2 DP2 offload", "FSDP2 DP2 offload 0.5",
                         "DP2 dist-opt offload"}, out
    for name, row in rows.items():
        device, planned = float(row[0]), float(row[1])
        assert abs(device - planned) <= 0.10 * planned, (name, row)
    for dp in (1, 2, 4):
        device, zero3 = float(rows[f"FSDP2 DP{dp}"][0]), float(rows[f"FSDP2 DP{dp}"][3])
        assert zero3 == 16 / dp and abs(device - zero3) <= 0.10 * zero3, (dp, rows)
    assert float(rows["FSDP2 DP2 offload"][0]) < float(rows["FSDP2 DP2"][0])  # the host took the rest
    assert float(rows["FSDP2 DP2 offload"][3]) > 0  # host bytes


@pytest.mark.timeout(600)
def test_fsdp_throughput_prints_a_ratio_per_round():
    out = run_script("fsdp_throughput.py", *TINY_BENCH, "--batch", "4", "--steps", "1", "--rounds", "1",
                     timeout=540)
    assert "median FSDP2/dist-opt tokens/s ratio" in out
    row = next(line for line in out.splitlines() if line.startswith("0 "))
    assert float(row.split()[-1]) > 0, out
