"""pretrain_gpt.py with --use-torch-fsdp2 and --optimizer-cpu-offload, fp32 end to end: the lm loss of
every iteration equals one process's (rel 1e-5), and checkpoints move between FSDP2 and the other
layouts (DP 2 distributed optimizer -> FSDP2 DP 4 with offload -> DP 2 plain DDP) with the
uninterrupted run's losses. main() runs on forked ranks (the imports are paid once for the test
process, not per rank)."""

import pytest

from tests.helpers.flags import tiny_flags
from tests.helpers.launch import losses
from tests.helpers.main_ranks import main_stdout

# NullTokenizer adds an eod id: 127 + 1 = 128 pads to 128 at TP 1 and TP 2 alike.
MODEL = tiny_flags() + [
    "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-2", "--lr-decay-iters", "7",
    "--num-workers", "0", "--mock-data", "--vocab-size", "127", "--make-vocab-size-divisible-by", "32",
    "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--lr-warmup-iters", "1", "--clip-grad", "0.5"]
FSDP = ["--use-torch-fsdp2"]
OFFLOAD = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]


def _run(nproc, args, workdir, cache):
    out = main_stdout(nproc, MODEL + cache + args, workdir)
    return out, losses(out)


def _same(got: dict, expected: dict, iterations):
    assert sorted(got) == list(iterations), got
    for it in iterations:
        assert abs(got[it] - expected[it]) <= 1e-5 * abs(expected[it]), (it, got[it], expected[it])


@pytest.mark.slow
def test_fsdp2_and_offload_log_the_single_process_losses_and_reshard_checkpoints(tmp_path, mock_data_cache):
    _, expected = _run(1, ["--train-iters", "7"], tmp_path / "single", mock_data_cache)
    assert expected[7] < expected[1]  # it trains
    out, fsdp_tp2 = _run(4, FSDP + OFFLOAD + ["--train-iters", "5", "--tensor-model-parallel-size", "2",
                                              "--sequence-parallel"], tmp_path / "fsdp_tp2", mock_data_cache)
    assert "tp 2 pp 1 dp 2" in out
    _same(fsdp_tp2, expected, range(1, 6))

    a, b = str(tmp_path / "distopt2"), str(tmp_path / "fsdp4")
    _, dist_opt = _run(2, ["--use-distributed-optimizer", "--train-iters", "3", "--save", a],
                       tmp_path / "distopt2_run", mock_data_cache)
    _same(dist_opt, expected, range(1, 4))
    _, fsdp4 = _run(4, FSDP + OFFLOAD + ["--train-iters", "5", "--load", a, "--save", b],
                    tmp_path / "fsdp4_run", mock_data_cache)
    _same(fsdp4, expected, range(4, 6))
    _, plain = _run(2, ["--train-iters", "7", "--load", b], tmp_path / "plain_run", mock_data_cache)
    _same(plain, expected, range(6, 8))
