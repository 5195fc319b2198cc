"""pretrain_gpt.py with --context-parallel-size end to end: the lm loss of one process, and a CP 2
checkpoint continuing in one process (CP changes activations only, never parameters); main() on
forked ranks (the imports are paid once for the test process, not per rank)."""

import os

import pytest

from tests.helpers.flags import tiny_flags
from tests.helpers.launch import losses
from tests.helpers.main_ranks import main_stdout

# Llama-like (RoPE on half of each head, GQA, RMSNorm, SwiGLU); 127 + eod pads to 128 at TP 1 and 2.
MODEL = tiny_flags() + [
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-2",
    "--num-workers", "0", "--mock-data", "--vocab-size", "127", "--make-vocab-size-divisible-by", "32",
    "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--lr-warmup-iters", "1", "--position-embedding-type", "rope",
    "--rotary-percent", "0.5", "--group-query-attention", "--num-query-groups", "2",
    "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64"]


def _close(got: dict, expected: dict, iterations) -> None:
    assert sorted(got) == list(iterations), got
    for it in iterations:
        assert abs(got[it] - expected[it]) <= 1e-5 * abs(expected[it]), (it, got[it], expected[it])


@pytest.mark.slow
def test_cp2_and_cp2_tp2_pp2_log_the_single_process_losses(tmp_path, mock_data_cache):
    single = main_stdout(1, MODEL + mock_data_cache, tmp_path / "single")
    expected = losses(single)
    assert expected[5] < expected[1]  # it trains
    cp2 = main_stdout(2, MODEL + mock_data_cache + ["--context-parallel-size", "2"], tmp_path / "cp2")
    assert "tp 1 cp 2 pp 1 dp 1" in cp2
    _close(losses(cp2), expected, [1, 2, 3, 4, 5])
    grid = main_stdout(8, MODEL + mock_data_cache + [
        "--context-parallel-size", "2", "--cp-comm-type", "allgather", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--pipeline-model-parallel-size", "2"], tmp_path / "grid")
    assert "tp 2 cp 2 pp 2 dp 1" in grid
    _close(losses(grid), expected, [1, 2, 3, 4, 5])


@pytest.mark.slow
def test_checkpoint_saved_at_cp2_continues_in_one_process(tmp_path, mock_data_cache):
    """CP 2 x DP 2 with the distributed optimizer (sharded over DP x CP) saves at iteration 3;
    one process loads it and logs the original run's losses for 4 (weights) and 5 (Adam state)."""
    ckpt = str(tmp_path / "ckpt")
    original = main_stdout(4, MODEL + mock_data_cache + [
        "--context-parallel-size", "2", "--use-distributed-optimizer", "--save", ckpt,
        "--save-interval", "3"], tmp_path / "cp2dp2")
    assert "tp 1 cp 2 pp 1 dp 2" in original
    expected = losses(original)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")  # the run also saved iteration 5 at its end
    single = main_stdout(1, MODEL + mock_data_cache + ["--load", ckpt], tmp_path / "single")
    assert "RNG states are per rank, so they are not restored" in single
    _close(losses(single), expected, [4, 5])
