"""pretrain_gpt.py with --use-torch-fsdp2 and --optimizer-cpu-offload, fp32 end to end: the lm loss of
every iteration equals one process's (rel 1e-5), and checkpoints move between FSDP2 and the other
layouts (DP 2 distributed optimizer -> FSDP2 DP 4 with offload -> DP 2 plain DDP) with the
uninterrupted run's losses."""

import pytest

from tests.training.launch import losses, torchrun

# NullTokenizer adds an eod id: 127 + 1 = 128 pads to 128 at TP 1 and TP 2 alike.
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-2", "--lr-decay-iters", "7",
         "--num-workers", "0", "--mock-data", "--vocab-size", "127", "--make-vocab-size-divisible-by", "32",
         "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--lr-warmup-iters", "1", "--clip-grad", "0.5"]
FSDP = ["--use-torch-fsdp2"]
OFFLOAD = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]


def _run(nproc, args, cwd):
    result = torchrun(nproc, MODEL + args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, losses(result.stdout)


def _same(got: dict, expected: dict, iterations):
    assert sorted(got) == list(iterations), got
    for it in iterations:
        assert abs(got[it] - expected[it]) <= 1e-5 * abs(expected[it]), (it, got[it], expected[it])


@pytest.mark.slow
def test_fsdp2_and_offload_log_the_single_process_losses_and_reshard_checkpoints(tmp_path):
    _, expected = _run(1, ["--train-iters", "7"], tmp_path)
    assert expected[7] < expected[1]  # it trains
    out, fsdp_tp2 = _run(4, FSDP + OFFLOAD + ["--train-iters", "5", "--tensor-model-parallel-size", "2",
                                              "--sequence-parallel"], tmp_path)
    assert "tp 2 pp 1 dp 2" in out.stdout
    _same(fsdp_tp2, expected, range(1, 6))

    a, b = str(tmp_path / "distopt2"), str(tmp_path / "fsdp4")
    _, dist_opt = _run(2, ["--use-distributed-optimizer", "--train-iters", "3", "--save", a], tmp_path)
    _same(dist_opt, expected, range(1, 4))
    _, fsdp4 = _run(4, FSDP + OFFLOAD + ["--train-iters", "5", "--load", a, "--save", b], tmp_path)
    _same(fsdp4, expected, range(4, 6))
    _, plain = _run(2, ["--train-iters", "7", "--load", b], tmp_path)
    _same(plain, expected, range(6, 8))
