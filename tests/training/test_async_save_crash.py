"""--async-save is crash-safe (issue 40): SIGKILL of every rank while the background writer writes,
once every rank's files are written, or just before the finalize commits, leaves the previous
checkpoint the latest, and it loads whole; the restarted job resumes from it and replaces the stale
directory. The writer is slowed (a sleep per written tensor) so that each moment is hit for sure."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megafab.checkpoint import megatron_dist
from tests.helpers.child_hooks import startup_hook_env
from tests.helpers.main_ranks import run_ranks_main, start_ranks, wait_for_text
from tests.helpers.tiny_corpus import TINY, assert_one_message, write_corpus

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="these tests fork their ranks")
TRACKER = "latest_checkpointed_iteration.txt"
SLOW_ITEM_S = 0.03


def _flags(corpus, iters, save, *extra):
    return TINY + ["--train-iters", str(iters), "--lr-decay-iters", "6", "--data-path", corpus, "--split",
                   "90,5,5", "--global-batch-size", "2", "--use-distributed-optimizer",
                   "--save-interval", "2",
                   "--save", save, "--async-save", "--use-persistent-ckpt-worker", *extra]


# Run by each rank's writer process at its start (a sitecustomize.py on its PYTHONPATH): the writer
# sleeps per tensor, and marks (outside the checkpoint) when it starts and ends a rank's files of a save.
SLOW_WRITER = f"""
import os, time
marks = os.environ.get("MEGAFAB_TEST_MARKS")
if marks:
    import torch.distributed.checkpoint.filesystem as fs
    from megafab.checkpoint import writer_process

    write_item, run_job = fs._write_item, writer_process.run_job

    def slow_item(*args, **kwargs):
        time.sleep({SLOW_ITEM_S})
        return write_item(*args, **kwargs)

    def marked_job(block, job):
        name = os.path.basename(job.path) + "." + str(job.rank)
        with open(os.path.join(marks, "writing." + name), "w") as f:
            f.write(str(os.getpid()))
        out = run_job(block, job)
        open(os.path.join(marks, "written." + name), "w").close()
        return out

    fs._write_item, writer_process.run_job = slow_item, marked_job
"""


def _slow_writer_env(tmp_path, marks: str) -> dict:
    env = startup_hook_env(tmp_path / "writer_hook", SLOW_WRITER, {})
    return {"PYTHONPATH": env["PYTHONPATH"], "MEGAFAB_TEST_MARKS": marks}


def _marked_commit(marks: str):
    """before_main: the rank marks when the finalize of iteration 4 starts, then waits 2 s."""
    def hook(rank: int) -> None:
        from megafab.checkpoint import async_save

        commit = async_save._commit

        def marked_commit(p):
            if p.iteration == 4:
                open(os.path.join(marks, "finalizing.4"), "w").close()
                time.sleep(2.0)
            commit(p)
        async_save._commit = marked_commit
    return hook


def _wait_for(paths, job, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        job.poll()
        assert not job.codes and time.monotonic() < deadline, f"never saw {paths}: {job.codes}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "good"))


MOMENTS = ["while writing", "every rank's files written", "just before the finalize commits"]


@pytest.mark.parametrize("moment", MOMENTS)
def test_sigkill_during_an_async_save_leaves_the_previous_checkpoint_latest(corpus, tmp_path, moment):
    save, marks = str(tmp_path / "ckpt"), str(tmp_path / "marks")
    os.makedirs(marks)
    with start_ranks(2, _flags(corpus, 100000, save), tmp_path / "log", env=_slow_writer_env(tmp_path, marks),
                     before_main=_marked_commit(marks)) as job:
        if moment == MOMENTS[0]:
            wait_for_text(job, 0, "scheduled an async checkpoint save at iteration       4", timeout=60)
            time.sleep(0.2)
        elif moment == MOMENTS[1]:
            _wait_for([os.path.join(marks, f"written.iter_0000004.tmp.{r}") for r in (0, 1)], job)
        else:
            _wait_for([os.path.join(marks, "finalizing.4")], job)
        for pid in job.pids:
            os.kill(pid, signal.SIGKILL)
        result = job.wait(timeout=30)
    assert result.codes == [-signal.SIGKILL] * 2, result.describe()
    assert open(os.path.join(save, TRACKER)).read() == "2"
    assert not os.path.exists(os.path.join(save, "iter_0000004"))
    assert os.path.isdir(os.path.join(save, "iter_0000004.tmp"))  # the killed save's, never committed
    tensors = megatron_dist.TorchDistSource(os.path.join(save, "iter_0000002")).read_all()
    assert tensors and all(t.numel() for t in tensors.values())
    if moment == MOMENTS[2]:  # .metadata was written: still not a checkpoint; the restart resumes from 2
        assert os.path.exists(os.path.join(save, "iter_0000004.tmp", ".metadata"))
        resumed = run_ranks_main(2, _flags(corpus, 4, save, "--load", save), tmp_path / "again", timeout=120)
        assert resumed.codes == [0, 0], resumed.describe()
        assert "loaded checkpoint from" in resumed.out[0] and "at iteration 2 " in resumed.out[0]
        assert open(os.path.join(save, TRACKER)).read() == "4"
        assert sorted(os.listdir(save)) == sorted(["iter_0000002", "iter_0000004", "metrics.jsonl", TRACKER,
                                                   "resolved_config.toml"])  # the stale .tmp is gone


def _error_at_iteration_3(rank: int) -> None:
    """before_main: a user error (one message) raised in iteration 3's step."""
    from megafab.errors import MegafabError
    from megafab.training import pretrain

    step = pretrain.train_step

    def failing_step(state, *args, **kwargs):
        if state.iteration == 2:
            raise MegafabError("a user error in iteration 3")
        return step(state, *args, **kwargs)
    pretrain.train_step = failing_step


def test_an_error_with_a_save_pending_waits_for_the_writer_and_commits_nothing(corpus, tmp_path):
    save, marks = str(tmp_path / "ckpt"), str(tmp_path / "marks")
    os.makedirs(marks)
    result = run_ranks_main(2, _flags(corpus, 100000, save), tmp_path / "log", timeout=120,
                            env=_slow_writer_env(tmp_path, marks), before_main=_error_at_iteration_3)
    assert result.codes == [2, 2], result.describe()
    assert "a user error in iteration 3" in result.err[0]
    note = "the asynchronous save of iteration 2 was finalized; no checkpoint yet stays the latest"
    assert note in result.out[0]
    assert not os.path.exists(os.path.join(save, TRACKER))
    # each rank waited for its writer: its files of iteration 2 are complete, though never committed
    assert all(os.path.exists(os.path.join(marks, f"written.iter_0000002.tmp.{r}")) for r in (0, 1))


def test_a_killed_writer_process_fails_its_save_with_one_message_and_the_previous_stays(corpus, tmp_path):
    """SIGKILL of rank 0's writer process while it writes iteration 4: every rank stops with one
    message naming the directory and the dead writer; iteration 2 stays the latest and a restart
    resumes from it."""
    save, marks = str(tmp_path / "ckpt"), str(tmp_path / "marks")
    os.makedirs(marks)
    with start_ranks(2, _flags(corpus, 100000, save), tmp_path / "log",
                     env=_slow_writer_env(tmp_path, marks)) as job:
        writing = os.path.join(marks, "writing.iter_0000004.tmp.0")
        _wait_for([writing], job)
        time.sleep(0.1)
        writer = int(open(writing).read())
        assert writer not in job.pids  # a process of its own, not the rank
        os.kill(writer, signal.SIGKILL)
        result = job.wait(timeout=60)
    line = assert_one_message(result, r"writing the checkpoint files into .*iter_0000004\.tmp failed on rank "
                                      r"0 \(the checkpoint writer process \(pid \d+\) was killed by SIGKILL")
    assert "iteration 2 stays the latest" in line, line
    assert open(os.path.join(save, TRACKER)).read() == "2"
    assert not os.path.exists(os.path.join(marks, "written.iter_0000004.tmp.0"))
    resumed = run_ranks_main(2, _flags(corpus, 4, save, "--load", save), tmp_path / "again", timeout=120)
    assert resumed.codes == [0, 0], resumed.describe()
    assert "at iteration 2 " in resumed.out[0]
    assert open(os.path.join(save, TRACKER)).read() == "4"
