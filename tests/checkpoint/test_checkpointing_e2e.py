"""pretrain_gpt.py checkpoints end to end: exact resume after SIGKILL, a SIGKILL during a save,
resharding across TP/PP/DP layouts, and SIGTERM with --exit-signal-handler. main() runs on forked
ranks (tests/helpers/main_ranks.py: the imports are paid once for the test process, not per rank);
torchrun's own part (restarts, its summary) is tested in tests/training."""

import os
import signal

import pytest

from megafab.checkpoint.directory import latest_iteration
from tests.helpers.flags import tiny_flags
from tests.helpers.launch import losses
from tests.helpers.main_ranks import main_stdout, start_ranks, wait_for_text

# NullTokenizer adds an eod id: 127 + 1 = 128 pads to 128 at TP 1, 2 and 4 alike.
TINY = tiny_flags() + [
    "--micro-batch-size", "1", "--num-workers", "0", "--mock-data", "--vocab-size", "127",
    "--make-vocab-size-divisible-by", "32", "--lr", "1e-2", "--lr-warmup-iters", "1", "--log-interval", "1",
    "--eval-interval", "1000", "--eval-iters", "1"]


def pause_before_committing_iteration_20(rank: int) -> None:
    """Rank 0 pauses before committing the save of iteration 20 (the test kills the job there,
    while only the temporary directory exists); installed in the forked ranks by the test."""
    if rank != 0:
        return
    import time

    from megafab.checkpoint import checkpointing

    commit = checkpointing.commit_checkpoint

    def paused_commit(root, iteration, *args):
        if iteration == 20:
            print(f"test hook: pause before committing iteration {iteration}", flush=True)
            time.sleep(600)
        return commit(root, iteration, *args)

    checkpointing.commit_checkpoint = paused_commit


def _stdout(job) -> str:
    return "".join(job.output(rank) for rank in range(len(job.pids)))


@pytest.mark.slow
def test_resume_after_sigkill_and_a_kill_during_save_matches_the_straight_run(tmp_path, mock_data_cache):
    """DP2 with the distributed optimizer and dropout on (so RNG restore matters).

    One job trains 20 iterations straight, saving at 10 and 20; a test hook pauses it inside the
    save of iteration 20, after every rank has written its files into iter_0000020.tmp and
    before the rename, and SIGKILL to every rank lands there. A second job resumes
    with --load: it must start from 10 (the last complete checkpoint) and log the same losses for
    11-20 as the job that never stopped.
    """
    args = TINY + mock_data_cache + ["--global-batch-size", "4", "--train-iters", "20",
                                     "--use-distributed-optimizer"]
    ckpt = str(tmp_path / "ckpt")
    save = ["--save", ckpt, "--save-interval", "10"]
    pause = pause_before_committing_iteration_20
    with start_ranks(2, args + save, tmp_path / "killed", before_main=pause) as job:
        wait_for_text(job, 0, "test hook: pause before committing iteration 20", timeout=240)
        job.kill()
    expected = losses(_stdout(job))
    assert sorted(expected) == list(range(1, 21))
    assert latest_iteration(ckpt) == 10
    assert os.path.isdir(os.path.join(ckpt, "iter_0000020.tmp"))  # the interrupted save
    assert not os.path.exists(os.path.join(ckpt, "iter_0000020"))

    resumed = main_stdout(2, args + save + ["--load", ckpt], tmp_path / "resumed")
    assert f"loaded checkpoint from {ckpt} at iteration 10" in resumed
    got = losses(resumed)
    assert sorted(got) == list(range(11, 21))
    assert [got[i] for i in range(11, 21)] == [expected[i] for i in range(11, 21)]
    assert latest_iteration(ckpt) == 20
    assert sorted(os.listdir(ckpt)) == ["iter_0000010", "iter_0000020", "latest_checkpointed_iteration.txt",
                                        "metrics.jsonl", "resolved_config.toml"]  # the stale .tmp is gone


def _close(got: dict, expected: dict, iters) -> None:
    for it in iters:
        assert abs(got[it] - expected[it]) <= 1e-5 * abs(expected[it]), (it, got[it], expected[it])


@pytest.mark.slow
def test_checkpoint_of_tp2_pp2_dp2_loads_into_tp1_and_tp4_dp2(tmp_path, mock_data_cache):
    """Saved at iteration 3 by TP2 x PP2 (VPP2) x DP2 + SP + distributed optimizer with SwiGLU
    (stride-2 fc1) and tied embeddings; the next two iterations (4: weights; 5: also the Adam
    state) log the original layout's losses in one process and at TP4 x DP2."""
    model = TINY + mock_data_cache + ["--global-batch-size", "8", "--train-iters", "5", "--hidden-dropout",
                                      "0", "--attention-dropout", "0", "--swiglu", "--ffn-hidden-size", "64"]
    ckpt = str(tmp_path / "ckpt")
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "1", "--sequence-parallel",
              "--use-distributed-optimizer"]
    original = main_stdout(8, model + layout + ["--save", ckpt, "--save-interval", "3"], tmp_path / "3d")
    expected = losses(original)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")  # pick the iteration-3 checkpoint (the run also saved 5 at its end)

    single = main_stdout(1, model + ["--load", ckpt], tmp_path / "single")
    assert "RNG states are per rank, so they are not restored" in single
    got = losses(single)
    assert sorted(got) == [4, 5]
    _close(got, expected, [4, 5])

    tp4 = main_stdout(8, model + ["--tensor-model-parallel-size", "4", "--sequence-parallel",
                                  "--use-distributed-optimizer", "--load", ckpt], tmp_path / "tp4")
    got = losses(tp4)
    assert sorted(got) == [4, 5] and "tp 4 pp 1 dp 2" in tp4
    _close(got, expected, [4, 5])


@pytest.mark.slow
def test_sigterm_with_exit_signal_handler_saves_and_exits_zero(tmp_path, mock_data_cache):
    """SLURM preemption sends SIGTERM to the ranks; here one rank gets it, every rank must stop
    at the same iteration, save it and leave with exit code 0."""
    ckpt = str(tmp_path / "ckpt")
    args = TINY + mock_data_cache + ["--global-batch-size", "2", "--train-iters", "100000",
                                     "--exit-signal-handler", "--save", ckpt]
    with start_ranks(2, args, tmp_path / "job") as job:
        wait_for_text(job, 1, "iteration        3/", timeout=240)
        os.kill(job.pids[-1], signal.SIGTERM)
        result = job.wait(timeout=120)
    assert result.codes == [0, 0], result.describe()
    out = "".join(result.out)
    stopped = int(out.split("exiting at iteration ")[1].split(":")[0])
    assert "SIGTERM received" in out and stopped >= 3
    assert latest_iteration(ckpt) == stopped
    assert max(losses(out)) == stopped
    assert os.path.isfile(os.path.join(ckpt, f"iter_{stopped:07d}", "metadata.json"))
