"""The step-time model's predictions, pinned: a refactor of step_time.py and its CPU terms must give
every layout the same step and breakdown on a built-in GPU node and on a measured CPU profile; and
a GPU node's prediction never reaches a CPU-only term (megafab.plan.host_terms).

A deliberate change to the model re-records them: python -m tests.plan.test_step_time_golden
(it rewrites step_time_golden.json beside this file; say in the commit why the numbers moved).
"""

import json
import os

import pytest

from megafab.plan import collectives, host_terms
from megafab.plan.machines import BUILTIN, Machine
from megafab.plan.planner import plan
from megafab.plan.step_time import predict
from tests.helpers.flags import planned_gpt

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_time_golden.json")

_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _cpu_profile() -> Machine:
    """A measured CPU profile's shape: GEMM points, loop and in-step collective entries (":step",
    ":fsdp"), host overheads per sharding, 2 cores that 4 ranks share, a busy slowdown."""
    collectives = {op: {"2": [4e-4, 8e8], "4": [9e-4, 6e8], "2@2": [5e-4, 8e8], "2@2:step": [3e-3, 8e8],
                        "4@4": [1.1e-3, 6e8], "2@4": [7e-4, 8e8], "2@4:step": [4e-3, 8e8],
                        "4@4:step": [5e-3, 6e8]} for op in _OPS}
    for op in ("all_gather", "reduce_scatter"):
        collectives[op].update({"2@2:fsdp": [1.2e-3, 8e8], "4@4:fsdp": [2e-3, 6e8],
                                "2@4:fsdp": [1.5e-3, 8e8]})
    collectives["send_recv"] = {"2": [2e-4, 2e9], "2@2": [3e-4, 2e9]}

    def host(scale):
        return {"step_s": 6e-4 * scale, "micro_batch_s": 4e-4 * scale, "layer_micro_batch_s": 3e-4 * scale,
                "param_tensor_s": 1.5e-5 * scale, "recomputed_layer_micro_batch_s": 2.5e-4,
                "selective_layer_micro_batch_s": 6e-5}

    return Machine(
        name="cpu", peak_tflops={"float32": 0.08, "float16": 0.01}, device_memory_gib=16, hbm_bandwidth=1e10,
        gpus_per_node=1024, intra_busbw=8e8, intra_latency_s=4e-4, nic_bandwidth=2e9, inter_latency_s=2e-4,
        gemm_efficiency=1.0, kernel_overhead_s=0.0, attention_fwd_efficiency=0.3,
        attention_bwd_efficiency=0.2, attention_seq_half=0.0, hbm_efficiency=1.0,
        gemm_points=[[64, 64, 64, "float32", 2e-5], [256, 256, 256, "float32", 6e-4],
                     [1024, 1024, 1024, "float32", 3e-2]],
        collectives=collectives, iteration_overhead_s=0.0, compute_slots=2, busy_slowdown=1.2,
        host_overheads={"none": host(1.0), "distributed_optimizer": host(1.3), "fsdp2": host(2.0)})


MACHINES = {"h100": BUILTIN["h100-sxm-80gb"], "a100-4": Machine(**{**vars(BUILTIN["a100-sxm-80gb"]),
                                                                  "gpus_per_node": 4}),
            "cpu": _cpu_profile()}
_TP2, _PP2, _PP4 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"], \
    ["--pipeline-model-parallel-size", "4"]
_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
# (name, flags on the step-time tests' GPT, world, tp_comm_overlap)
CASES = [
    ("ddp-1", [], 1, False),
    ("ddp-2", [], 2, False),
    ("ddp-4-overlap", ["--overlap-grad-reduce"], 4, False),
    ("distopt-4", ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], 4,
     False),
    ("fsdp2-2", ["--use-torch-fsdp2"], 2, False),
    ("fsdp2-4-full", ["--use-torch-fsdp2", "--recompute-granularity", "full", "--recompute-method",
                      "uniform", "--recompute-num-layers", "1"], 4, False),
    ("tp2", _TP2, 2, False),
    ("tp2-sp-overlap", _TP2 + ["--sequence-parallel"], 4, True),
    ("pp2", _PP2, 2, False),
    ("pp2-dp2-selective", _PP2 + ["--recompute-granularity", "selective"], 4, False),
    ("pp4", _PP4, 4, False),
    ("pp2-vpp", _PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"], 4, False),
    ("pp2-tp2-block", _PP2 + _TP2 + ["--recompute-granularity", "full", "--recompute-method", "block",
                                     "--recompute-num-layers", "1"], 4, False),
    ("cp2-p2p", ["--context-parallel-size", "2"], 2, False),
    ("cp2-a2a", ["--context-parallel-size", "2", "--cp-comm-type", "a2a"], 4, False),
    ("moe-ep2", _MOE, 2, False),
    ("moe-ep2-distopt", _MOE + ["--use-distributed-optimizer", "--moe-shared-expert-intermediate-size",
                                "64", "--disable-bias-linear"], 4, False),
    ("fp16-pp2", _PP2 + ["--fp16"], 2, False),
    ("offload", ["--use-distributed-optimizer", "--optimizer-cpu-offload"], 2, False),
    ("dp8-distopt", ["--use-distributed-optimizer", "--overlap-grad-reduce"], 8, False),  # 2 nodes of a100-4
    ("tp2-pp2-dp2-sp", _TP2 + _PP2 + ["--sequence-parallel"], 8, True),
    ("fsdp2-8-tp2", _TP2 + ["--use-torch-fsdp2"], 8, False),
]


def _predictions() -> dict:
    out = {}
    for name, flags, world, overlap in CASES:
        cfg = planned_gpt(flags, world)
        stages = plan(cfg)
        for machine_name, machine in MACHINES.items():
            pred = predict(cfg, machine, stages, tp_comm_overlap=overlap)
            out[f"{name}@{machine_name}"] = {
                "step_time_s": pred.step_time_s, "tokens_per_s": pred.tokens_per_s,
                "tflops_per_gpu": pred.tflops_per_gpu, "mfu": pred.mfu,
                **{f"breakdown.{k}": v for k, v in pred.breakdown.items()}}
    return out


def test_predictions_are_the_recorded_ones():
    with open(GOLDEN) as f:
        recorded = json.load(f)
    now = _predictions()
    assert set(now) == set(recorded)
    for case, values in recorded.items():
        assert set(now[case]) == set(values), case
        for key, value in values.items():
            assert now[case][key] == pytest.approx(value, rel=1e-12, abs=1e-15), (case, key)
    # the CPU terms are in the CPU profile's steps, and none of them in a GPU node's
    assert any(v["breakdown.host_micro_batches"] > 0 for k, v in now.items() if k.endswith("@cpu"))
    assert all(v["breakdown.host_micro_batches"] == 0 for k, v in now.items() if not k.endswith("@cpu"))


def test_a_gpu_node_never_reaches_the_cpu_terms(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a CPU-only term priced")

    for name in ("sharing", "host_overhead", "_host_seconds", "shared_pipeline_time"):
        monkeypatch.setattr(host_terms, name, refuse)
    monkeypatch.setattr(collectives, "in_step_entry", refuse)
    for _, flags, world, overlap in CASES:
        cfg = planned_gpt(flags, world)
        stages = plan(cfg)
        for gpu in ("h100", "a100-4"):
            assert predict(cfg, MACHINES[gpu], stages, tp_comm_overlap=overlap).step_time_s > 0
        with pytest.raises(AssertionError, match="CPU-only"):
            predict(cfg, MACHINES["cpu"], stages, tp_comm_overlap=overlap)


if __name__ == "__main__":
    with open(GOLDEN, "w") as f:
        json.dump(_predictions(), f, indent=1, sort_keys=True)
        f.write("\n")
