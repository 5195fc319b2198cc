"""Machine profiles, the shape-dependent compute times and the collective placement."""

import dataclasses
import json

import pytest

from megafab.errors import MegafabError
from megafab.plan.collectives import Placement, collective_seconds, placement
from megafab.plan.host_terms import sharing
from megafab.plan.machines import BUILTIN, Machine, machine


def test_builtin_profiles_round_trip_through_json(tmp_path):
    for name in ("h100-sxm-80gb", "h200-sxm-141gb", "a100-sxm-80gb", "b200"):
        path = tmp_path / f"{name}.json"
        BUILTIN[name].save(str(path))
        assert Machine.load(str(path)) == BUILTIN[name]
        assert machine(path=str(path)).peak("bfloat16") == BUILTIN[name].peak("bfloat16")


def test_unknown_machine_and_bad_files_are_user_errors(tmp_path):
    with pytest.raises(MegafabError, match="h100-sxm-80gb"):
        machine("h100")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "bogus": 1}))
    with pytest.raises(MegafabError, match="bogus"):
        Machine.load(str(bad))
    with pytest.raises(MegafabError, match="--profile"):
        Machine.load(str(tmp_path / "missing.json"))


def test_ranks_sharing_cores_take_turns_and_busy_cores_run_slower():
    cpu = dataclasses.replace(BUILTIN["h100-sxm-80gb"], compute_slots=2, busy_slowdown=1.2)
    assert sharing(cpu, 1) == 1.0  # alone: nothing shared
    assert sharing(cpu, 2) == pytest.approx(1.2)  # every core busy
    assert sharing(cpu, 4) == pytest.approx(2 * 1.2)  # two ranks per core, every core busy
    four = dataclasses.replace(cpu, compute_slots=4)
    assert sharing(four, 2) == pytest.approx(1 + 0.2 / 3)  # one of the 3 other cores busy
    assert sharing(BUILTIN["h100-sxm-80gb"], 8) == 1.0  # a GPU per rank


def test_small_gemms_run_far_below_peak_and_large_ones_near_the_sustained_rate():
    h100 = BUILTIN["h100-sxm-80gb"]

    def rate(m, n, k):
        return 2 * m * n * k / h100.gemm_seconds(m, n, k, "bfloat16", 2) / h100.peak("bfloat16")

    assert rate(256, 256, 256) < 0.1
    assert rate(1024, 1024, 1024) < rate(4096, 4096, 4096) < rate(16384, 16384, 16384) <= h100.gemm_efficiency
    assert rate(16384, 16384, 16384) > 0.9 * h100.gemm_efficiency
    assert rate(4096, 6144, 512) < rate(4096, 6144, 4096)  # a short inner dimension costs


def test_measured_gemm_points_replace_the_curve():
    m = Machine(name="t", peak_tflops={"float32": 1.0}, device_memory_gib=1, hbm_bandwidth=1e10,
                gpus_per_node=8, intra_busbw=1e9, intra_latency_s=1e-5, nic_bandwidth=1e9,
                inter_latency_s=1e-5,
                gemm_points=[[100, 100, 100, "float32", 2e-3], [1000, 1000, 1000, "float32", 0.5]])
    assert m.gemm_seconds(100, 100, 100, "float32", 4) == pytest.approx(2e-3)
    assert m.gemm_seconds(1000, 1000, 1000, "float32", 4) == pytest.approx(0.5)
    mid = m.gemm_seconds(300, 300, 300, "float32", 4)
    assert 2 * 300**3 / mid > 2 * 100**3 / 2e-3  # between the two measured rates
    assert 2 * 300**3 / mid < 2 * 1000**3 / 0.5


def test_groups_are_placed_by_megatrons_rank_order():
    # 64 ranks, 8 per node, TP 8, PP 2: TP inside a node, DP (4) across 4 nodes one rank each
    assert placement(64, 8, 1, 2, 8, ("tp",)) == Placement(8, 8, 1)
    assert placement(64, 8, 1, 2, 8, ("dp",)) == Placement(4, 1, 4)
    # TP 2: a DP group of 32 has 4 ranks on each of 8 nodes
    assert placement(64, 2, 1, 1, 8, ("dp",)) == Placement(32, 4, 8)


def test_ring_collectives_follow_the_bus_bandwidth_factors():
    h100 = BUILTIN["h100-sxm-80gb"]
    base, intra_step, inter_step = h100.collective_base_latency_s, h100.intra_latency_s, h100.inter_latency_s
    assert (base, intra_step, inter_step) == (8.4e-6, 3.4e-6, 14e-6)  # NCCL's ring/Simple tuning model
    intra = placement(8, 8, 1, 1, 8, ("tp",))
    size = 1e9
    ar = collective_seconds(h100, "all_reduce", size, intra)
    ag = collective_seconds(h100, "all_gather", size, intra)
    assert ar == pytest.approx(2 * 7 / 8 * size / h100.intra_busbw + base + 14 * intra_step)
    assert ag == pytest.approx(7 / 8 * size / h100.intra_busbw + base + 7 * intra_step)
    across = placement(64, 8, 1, 1, 8, ("dp",))  # one rank per node: one NIC, every step crosses
    assert collective_seconds(h100, "all_gather", size, across) == pytest.approx(
        7 / 8 * size / h100.nic_bandwidth + base + 7 * inter_step)
    assert collective_seconds(h100, "all_reduce", size, across) == pytest.approx(
        2 * 7 / 8 * size / h100.nic_bandwidth + base + 14 * inter_step)


def test_ring_latency_counts_the_steps_that_cross_nodes_and_grows_with_the_group():
    """NCCL's ring: of a 384-rank ring with 4 ranks on each of 96 nodes, 95 steps cross the
    network and 288 stay on NVLink; each call pays them, so a gather per layer pays them per layer.
    NCCL runs the fastest protocol: LL for a tiny message; for a large one over this many steps
    LL128 (lower step latencies, 0.92 of the bandwidth) beats Simple."""
    h100 = BUILTIN["h100-sxm-80gb"]
    dp384 = placement(768, 2, 1, 1, 8, ("dp",))
    assert dp384 == Placement(384, 4, 96)
    tiny = 1.0  # bytes: the latency alone
    latency = collective_seconds(h100, "reduce_scatter", tiny, dp384)
    # LL: 6.6 us base, NVLink steps at the 1 us network post overhead, 2.7 us per network step
    assert latency == pytest.approx(6.6e-6 + 288 * 1e-6 + 95 * 2.7e-6, rel=1e-6)
    large = 1e9
    simple = 383 / 384 * large / (4 * h100.nic_bandwidth) + 8.4e-6 + 288 * 3.4e-6 + 95 * 14e-6
    ll128 = 383 / 384 * large / (0.92 * 4 * h100.nic_bandwidth) + 14e-6 + 288 * 1.9e-6 + 95 * 4e-6
    assert ll128 < simple
    assert collective_seconds(h100, "all_gather", large, dp384) == pytest.approx(ll128, rel=1e-6)
    one_node = placement(8, 8, 1, 1, 8, ("tp",))  # 7 NVLink steps: Simple's full bandwidth wins
    assert collective_seconds(h100, "all_gather", large, one_node) == pytest.approx(
        7 / 8 * large / h100.intra_busbw + 8.4e-6 + 7 * 3.4e-6, rel=1e-6)
    dp48 = placement(768, 8, 1, 2, 8, ("dp",))  # TP 8 PP 2: one rank per node
    assert collective_seconds(h100, "all_gather", tiny, dp48) == pytest.approx(6.6e-6 + 47 * 2.7e-6, rel=1e-6)
    assert latency > 3 * collective_seconds(h100, "all_gather", tiny, dp48)


@pytest.mark.slow
def test_profile_measures_this_machine_and_the_model_uses_it(tmp_path, monkeypatch):
    from megafab.arguments import config_from_args
    from megafab.calibrate import steps as step_calibration
    from megafab.calibrate.profile import measure
    from megafab.plan.planner import plan
    from megafab.plan.step_time import predict

    monkeypatch.setattr(step_calibration, "ROUNDS", 1)  # what is measured, not how well (a minute less)
    path = tmp_path / "here.json"
    measure("here", budget_s=10).save(str(path))
    here = Machine.load(str(path))
    assert here.gemm_points and here.peak("float32") > 0
    assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"} <= set(here.collectives)
    assert "2" in here.collectives["all_gather"]
    # in-step alphas from megafab's own steps at world 2 and 4 (megafab.calibrate.steps)
    assert {"2@2", "2@2:step", "4@4", "2@4", "2@4:step"} <= set(here.collectives["all_reduce"])
    assert "2@2" in here.collectives["send_recv"] and "2@4" not in here.collectives["send_recv"]
    assert {"2@2:fsdp", "4@4:fsdp", "2@4:fsdp"} <= set(here.collectives["all_gather"])
    # the calibration rows are kept with their measured steps (a later run's drift probe)
    assert len(here.calibration_steps) == len(step_calibration.CALIBRATION_LAYOUTS)
    assert all(row["step_s"] > 0 for row in here.calibration_steps)
    fits = [(alpha, busbw) for table in here.collectives.values() for alpha, busbw in table.values()]
    assert all(alpha >= 0 and busbw > 0 for alpha, busbw in fits)
    assert here.busy_slowdown >= 1.0 and here.compute_slots >= 1
    # host overheads of megafab's train_step, per sharding (CPU): every layer's modules cost time
    assert set(here.host_overheads) == {"none", "distributed_optimizer", "fsdp2"}
    assert all(v >= 0 for terms in here.host_overheads.values() for v in terms.values())
    assert here.host_overheads["none"]["layer_micro_batch_s"] > 0
    cfg = config_from_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                            "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "1",
                            "--global-batch-size", "4", "--tensor-model-parallel-size", "2", "--dry-run"],
                           world_size=2)
    pred = predict(cfg, here, plan(cfg))
    assert pred.step_time_s > 0 and pred.breakdown["tp_comm"] > 0 and pred.breakdown["gemm"] > 0
    assert pred.breakdown["host_micro_batches"] > 0


def test_tp_pp_dp_mapping_places_the_pipeline_inside_a_node_and_the_replicas_across():
    """--use-tp-pp-dp-mapping's rank order reaches the planner's group placement: 16 ranks on 8-GPU
    nodes, TP 2 x PP 2 x DP 4: the PP group [0, 2] stays in a node (default order: [0, 8], two nodes),
    the DP group [0, 4, 8, 12] spans both."""
    from megafab.arguments import config_from_args
    from megafab.plan.collectives import group_placement
    from megafab.plan.machines import BUILTIN
    from tests.helpers.flags import tiny_flags

    node = BUILTIN["h100-sxm-80gb"]
    base = tiny_flags() + ["--micro-batch-size", "1", "--mock-data", "--vocab-size", "100", "--lr", "1e-4",
                           "--train-iters", "1", "--tensor-model-parallel-size", "2",
                           "--pipeline-model-parallel-size", "2"]
    default, mapped = (config_from_args(base + extra, world_size=16)
                       for extra in ([], ["--use-tp-pp-dp-mapping"]))
    assert node.gpus_per_node == 8
    assert (group_placement(default, node, "pp").nodes, group_placement(mapped, node, "pp").nodes) == (2, 1)
    assert (group_placement(default, node, "dp").nodes, group_placement(mapped, node, "dp").nodes) == (1, 2)
