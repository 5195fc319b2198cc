"""--log-params-norm as Megatron's calc_params_l2_norm: the L2 norm of every parameter once, after the
step, in the iteration line (` params norm: X |`), the JSON line and TensorBoard ("params-norm"); the
same value from a tensor-, pipeline- and data-parallel layout with the distributed optimizer as
from one process."""

from __future__ import annotations

import glob
import json
import math

import pytest
import torch

from tests.helpers.flags import tiny_flags
from tests.helpers.main_ranks import main_stdout

MODEL = tiny_flags(num_layers=2) + [
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-2",
    "--num-workers", "0", "--mock-data", "--vocab-size", "127", "--make-vocab-size-divisible-by", "32",
    "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--log-params-norm"]


def _norms(path) -> dict[int, float]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return {r["iteration"]: r["params_norm"] for r in rows if r["kind"] == "iteration"}


@pytest.mark.parametrize("precision", [[], ["--fp16", "--loss-scale", "128"]], ids=["fp32", "fp16"])
def test_params_norm_is_the_norm_of_the_saved_parameters(precision, tmp_path, mock_data_cache):
    """fp32: the parameters themselves; fp16: the model's fp16 values, the ones Megatron reads (and
    saves), not the fp32 masters."""
    out = main_stdout(1, MODEL + mock_data_cache + precision + [
        "--untie-embeddings-and-output-weights", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
        "--ckpt-format", "torch", "--no-save-optim", "--metrics-jsonl", str(tmp_path / "m.jsonl")],
        tmp_path / "run")
    norms = _norms(tmp_path / "m.jsonl")
    assert sorted(norms) == [1, 2] and norms[1] != norms[2]  # after each step: the update moved it
    assert f" params norm: {norms[2]:.3f} |" in out
    [path] = glob.glob(str(tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"))
    model = torch.load(path, map_location="cpu", weights_only=False)["model"]
    weights = [t for k, t in model.items() if isinstance(t, torch.Tensor) and "_extra_state" not in k]
    expected = math.sqrt(sum(float(t.double().pow(2).sum()) for t in weights))
    assert abs(norms[2] - expected) <= 1e-6 * expected, (norms[2], expected)


LAYOUTS = {  # world, flags
    # a tied embedding (its second copy on the last stage counted once), DP 2: each rank's shard
    "tp2-pp2-distopt": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                            "--use-distributed-optimizer"]),
    "fsdp2-dp2": (2, ["--use-torch-fsdp2"]),  # ZeRO-3: each rank's parameter shards
    # optimizer CPU offload: half the entries' mains on the host
    "distopt-dp2-offload-0.5": (2, ["--use-distributed-optimizer", "--optimizer-cpu-offload",
                                    "--optimizer-offload-fraction", "0.5",
                                    "--use-precision-aware-optimizer"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_params_norm_of_a_parallel_layout_equals_one_process(layout, tmp_path, mock_data_cache):
    """After each of two steps (fp32: the layouts train alike to ~1e-6; in bf16 their roundings part
    by ~4e-5 at the second step)."""
    world, layout_flags = LAYOUTS[layout]
    flags = MODEL + mock_data_cache
    main_stdout(1, flags + ["--metrics-jsonl", str(tmp_path / "one.jsonl")], tmp_path / "one")
    main_stdout(world, flags + layout_flags + ["--metrics-jsonl", str(tmp_path / "n.jsonl")], tmp_path / "n")
    one, parallel = _norms(tmp_path / "one.jsonl"), _norms(tmp_path / "n.jsonl")
    assert sorted(one) == sorted(parallel) == [1, 2]
    for it in one:
        assert abs(parallel[it] - one[it]) <= 1e-5 * one[it], (it, parallel[it], one[it])

def test_params_norm_goes_to_the_line_json_and_tensorboard_on_their_iterations(capsys, tmp_path):
    """Computed (a collective) on every rank only on the iterations that report it."""
    import types

    from megafab.training import train_log
    from tests.helpers.tiny import tiny_config

    calls = []
    cfg = tiny_config(log_interval=2, tensorboard_log_interval=3, log_params_norm=True,
                      metrics_jsonl=str(tmp_path / "m.jsonl"))
    topo = types.SimpleNamespace(rank=0, world_size=1, dp_rank=0, device=torch.device("cpu"))
    log = train_log.TrainingLog(cfg, topo, 0)
    scalars = []
    log.writers = types.SimpleNamespace(scalars=lambda it, values, *a, **k: scalars.append((it, values)),
                                        close=lambda: None)
    optimizer = types.SimpleNamespace(grad_scaler=None, params_norm=lambda fp16: calls.append(fp16) or 2.5)
    state = types.SimpleNamespace(iteration=0, consumed_train_samples=0, optimizer=optimizer,
                                  scheduler=types.SimpleNamespace(get_lr=lambda: 1e-3))
    for _ in range(5):
        state.iteration += 1
        log.after_step(state, {"lm loss": 3.0, "grad_norm": 1.0, "num_zeros": None, "global_batch_size": 4,
                               "update_ok": True})
    log.close()
    assert len(calls) == 4  # iterations 1 (the first line), 2 and 4 (lines), 3 (TensorBoard); not 5
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert len(lines) == 3 and all(" grad norm: 1.000 | params norm: 2.500 |" in line for line in lines)
    assert [(it, v["params-norm"]) for it, v in scalars if "params-norm" in v] == [(3, 2.5)]
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["params_norm"] for r in rows] == [2.5, 2.5, 2.5]
