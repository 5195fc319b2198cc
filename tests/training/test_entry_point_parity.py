"""pretrain_gpt.py end to end: the 3D layout logs the same lm loss as one process (main() on forked
ranks: torchrun's worker start-up is paid once for the test process, not per rank)."""

import pytest

from tests.helpers.flags import tiny_flags
from tests.helpers.launch import losses
from tests.helpers.main_ranks import main_stdout

# NullTokenizer adds an eod id: 127 + 1 = 128 pads to 128 at TP 1 and TP 2 alike.
MODEL = tiny_flags() + [
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-2",
    "--num-workers", "0", "--mock-data", "--vocab-size", "127", "--make-vocab-size-divisible-by", "32",
    "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--lr-warmup-iters", "1"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--num-layers-per-virtual-pipeline-stage", "1", "--sequence-parallel",
          "--use-distributed-optimizer"]


@pytest.mark.slow
def test_3d_layout_logs_the_single_process_losses(tmp_path, mock_data_cache):
    single = main_stdout(1, MODEL + mock_data_cache, tmp_path / "single")
    parallel = main_stdout(8, MODEL + mock_data_cache + LAYOUT, tmp_path / "3d")
    expected, got = losses(single), losses(parallel)
    assert sorted(expected) == sorted(got) == [1, 2, 3, 4, 5]
    for it in expected:
        assert abs(got[it] - expected[it]) <= 1e-5 * abs(expected[it]), (it, got[it], expected[it])
    assert expected[5] < expected[1]  # it trains
    assert "tp 2 pp 2 dp 2" in parallel
