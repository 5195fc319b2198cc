"""Host overheads of the CPU step-time model: the profile's fit recovers its coefficients, predict
counts the layers, micro-batches and optimizer tensors as megafab builds them."""

import dataclasses

import pytest

from megafab.calibrate.collectives import fit as _fit
from megafab.calibrate.host import HOST_MODELS, fit_host_overheads
from megafab.calibrate.stats import line as _line
from megafab.plan.host_terms import HOST_TERMS
from megafab.plan.machines import BUILTIN
from megafab.plan.optimizer_tensors import param_tensors
from megafab.plan.planner import plan
from megafab.plan.step_time import predict
from megafab.run.fork_ranks import run_ranks
from tests.helpers.flags import planned_gpt

TRUE = {"none": dict(step_s=6e-4, micro_batch_s=4e-4, layer_micro_batch_s=3e-4, param_tensor_s=1.5e-5),
        "fsdp2": dict(step_s=9e-4, micro_batch_s=7e-4, layer_micro_batch_s=1.8e-3, param_tensor_s=3e-5)}


RECOMPUTED = 2.5e-4
SELECTIVE = 6e-5


def _synthetic_rows(opt_fixed=2e-4, rest=4e-4):
    rows = []
    for sharding, c in TRUE.items():
        for layers, m in HOST_MODELS:
            tensors = 4 + 12 * layers
            kernel_mb, kernel_opt = 1e-4 * layers + 5e-5, 3e-6 * tensors
            fb = m * (c["micro_batch_s"] + layers * c["layer_micro_batch_s"] + kernel_mb)
            opt = opt_fixed + tensors * c["param_tensor_s"] + kernel_opt
            rows.append({"sharding": sharding, "recompute": "none", "layers": layers, "micro_batches": m,
                         "param_tensors": tensors, "step_s": fb + opt + rest - opt_fixed,
                         "forward_backward_s": fb, "optimizer_s": opt,
                         "kernel_micro_batch_s": kernel_mb, "kernel_optimizer_s": kernel_opt})
    c = TRUE["none"]
    for layers in (1, 3):  # DDP with full recompute: the kernels' forward again and RECOMPUTED per layer
        kernel_mb = 1.3e-4 * layers + 5e-5
        fb = c["micro_batch_s"] + layers * (c["layer_micro_batch_s"] + RECOMPUTED) + kernel_mb
        rows.append({**rows[0], "recompute": "full", "layers": layers, "micro_batches": 1,
                     "forward_backward_s": fb, "kernel_micro_batch_s": kernel_mb})
    for layers in (1, 3):  # selective: the attention's kernels again and SELECTIVE per layer
        kernel_mb = 1.05e-4 * layers + 5e-5
        fb = c["micro_batch_s"] + layers * (c["layer_micro_batch_s"] + SELECTIVE) + kernel_mb
        rows.append({**rows[0], "recompute": "selective", "layers": layers, "micro_batches": 1,
                     "forward_backward_s": fb, "kernel_micro_batch_s": kernel_mb})
    return rows


def test_fit_recovers_the_host_coefficients_per_sharding():
    fitted = fit_host_overheads(_synthetic_rows(opt_fixed=2e-4, rest=4e-4))
    assert set(fitted) == set(TRUE)
    for sharding, c in TRUE.items():
        for term in HOST_TERMS:
            # step_s: the rest of the step (4e-4 minus the optimizer's fixed cost) + that fixed cost;
            # the recompute term, measured under DDP, for every sharding
            expected = {"step_s": 4e-4, "recomputed_layer_micro_batch_s": RECOMPUTED,
                        "selective_layer_micro_batch_s": SELECTIVE}.get(term, c.get(term))
            assert fitted[sharding][term] == pytest.approx(expected, rel=1e-9)


def test_fit_clamps_negative_noise_to_zero():
    rows = _synthetic_rows()
    for r in rows:  # more layers measured faster than the kernels alone: no negative per-layer cost
        r["forward_backward_s"] = r["micro_batches"] * (1e-3 - 4e-4 * r["layers"] + r["kernel_micro_batch_s"])
    assert fit_host_overheads(rows)["none"]["layer_micro_batch_s"] == 0.0


def test_collective_fit_weights_small_messages_for_alpha():
    # all-gather over 2 ranks, alpha 50 us, busbw 1 GB/s; the largest message 20% slow (noise)
    points = [(n, 50e-6 + 0.5 * n / 1e9) for n in (2**13, 2**17, 2**21)] + [(2**23, 1.2 * 0.5 * 2**23 / 1e9)]
    alpha, busbw = _fit(points, 0.5, 1)
    assert alpha == pytest.approx(50e-6, rel=0.1)
    assert 0.8e9 < busbw < 1e9
    unweighted = _line([0.5 * n for n, _ in points], [t for _, t in points])[0]
    assert unweighted < 0  # what a plain least-squares intercept makes of it


def test_predict_adds_each_stages_layers_and_the_ranks_optimizer_tensors():
    terms = dict(step_s=1e-3, micro_batch_s=2e-3, layer_micro_batch_s=3e-3, param_tensor_s=1e-5,
                 recomputed_layer_micro_batch_s=4e-3, selective_layer_micro_batch_s=5e-4)
    base = BUILTIN["h100-sxm-80gb"]
    machine = dataclasses.replace(base, host_overheads={"none": terms})
    cfg = planned_gpt(["--pipeline-model-parallel-size", "2"], 2)  # 2 layers per stage, 8 micro-batches
    with_host, without = predict(cfg, machine, plan(cfg)), predict(cfg, base, plan(cfg))
    assert with_host.breakdown["host_micro_batches"] == pytest.approx(8 * (2e-3 + 2 * 3e-3))
    assert param_tensors(cfg, 0) == 2 + 2 * 12  # word + position embeddings, 2 layers of 12
    assert param_tensors(cfg, 1) == 2 * 12 + 2 + 1  # 2 layers, final LayerNorm, the output layer
    assert with_host.breakdown["overhead"] == pytest.approx(base.iteration_overhead_s + 1e-3 + 1e-5 * 27)
    # the micro-batches' host time runs in the schedule: 8 micro-batches + 1 bubble slot per stage
    assert with_host.step_time_s - without.step_time_s == pytest.approx(
        (8 + 1) * (2e-3 + 2 * 3e-3) + 1e-3 + 1e-5 * 27, rel=1e-6)
    full = planned_gpt(["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                 "--recompute-method", "block", "--recompute-num-layers", "1"], 2)  # 1 of 2 per stage
    host = predict(full, machine, plan(full)).breakdown["host_micro_batches"]
    assert host == pytest.approx(8 * (2e-3 + 2 * 3e-3 + 4e-3))
    selective = planned_gpt(["--pipeline-model-parallel-size", "2", "--recompute-granularity",
                             "selective"], 2)
    host = predict(selective, machine, plan(selective)).breakdown["host_micro_batches"]
    assert host == pytest.approx(8 * (2e-3 + 2 * (3e-3 + 5e-4)))  # every layer's attention again
    vpp = planned_gpt(["--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "1"], 2)
    host = predict(vpp, machine, plan(vpp)).breakdown["host_micro_batches"]
    assert host == pytest.approx(8 * (2 * 2e-3 + 2 * 3e-3))  # a micro-batch's fixed cost in each chunk
    fsdp = planned_gpt(["--use-torch-fsdp2"], 2)  # no fsdp2 entry: DDP's terms
    host = predict(fsdp, machine, plan(fsdp)).breakdown["host_micro_batches"]
    assert host == pytest.approx(4 * (2e-3 + 4 * 3e-3))


def _built_tensors(rank, world, extra):
    import torch

    from benchmarks.bench_util import build_state

    torch.set_num_threads(1)
    cfg = planned_gpt(extra, world)
    state = build_state(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                         "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "256",
                         "--micro-batch-size", "1", "--global-batch-size", "8",
                         "--make-vocab-size-divisible-by", "1", "--lr", "1e-4", "--train-iters", "10",
                         "--mock-data"] + extra, world_size=world)
    pp_rank = state.topology.pp_rank
    return pp_rank, len(state.optimizer.entries), param_tensors(cfg, pp_rank)


@pytest.mark.parametrize("extra", [
    ["--use-distributed-optimizer"],
    ["--use-torch-fsdp2", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear"],
    ["--tensor-model-parallel-size", "2", "--qk-layernorm", "--position-embedding-type", "rope"],
    ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"],
    ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
     "--moe-grouped-gemm"],
    ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1,0,1]", "--swiglu",
     "--disable-bias-linear", "--moe-shared-expert-intermediate-size", "64"],
], ids=["distopt-dp2", "fsdp2-dp2", "tp2", "pp2-untied", "moe-ep2-grouped", "moe-shared-every-other"])
def test_param_tensors_match_a_built_models_optimizer_per_rank(extra):
    """param_tensors: the most any rank of the stage steps (the slowest rank's loop)."""
    results = run_ranks(_built_tensors, 2, extra, timeout=180)
    for stage in {r[0] for r in results}:
        built = [n for pp, n, _ in results if pp == stage]
        predicted = {p for pp, _, p in results if pp == stage}
        assert predicted == {max(built)}
