"""Ranks that die, freeze or restart (issue 18): the survivors end with one message naming the
collective, the iteration and the unreachable rank, within --distributed-timeout-minutes + 10 s;
torchrun --max-restarts resumes the job from its latest checkpoint by itself, on the losses of a
run that was never interrupted; validation resumes too."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import ROOT, free_port, losses
from tests.helpers.main_ranks import run_ranks_main, start_ranks, wait_for_text
from tests.helpers.tiny_corpus import TINY, assert_one_message, write_corpus

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="these tests fork their ranks")
VALIDATION = re.compile(r"validation loss at (.*?) \| lm loss value: ([0-9.E+-]+)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "good"))


def _train(corpus, iters, *extra):
    return TINY + ["--train-iters", str(iters), "--data-path", corpus, "--split", "90,5,5", *extra]


def _signal_a_rank(corpus, tmp_path, nproc, victim, sig, extra=()):
    """Start a long run, send `sig` to rank `victim` after iteration 3, wait for the others; (result,
    seconds from the signal to each rank's exit)."""
    with start_ranks(nproc, _train(corpus, 100000, *extra), tmp_path) as job:
        wait_for_text(job, nproc - 1, "iteration        3/")
        sent = time.monotonic() - job.started
        os.kill(job.pids[victim], sig)
        result = job.wait(timeout=60, ranks=[r for r in range(nproc) if r != victim])
    return result, [None if e is None else e - sent for e in result.elapsed]


@pytest.mark.parametrize("victim", [1, 0], ids=["a rank", "rank 0, the store's host"])
def test_survivor_of_a_killed_rank_names_it(corpus, tmp_path, victim):
    result, after = _signal_a_rank(corpus, tmp_path, 2, victim, signal.SIGKILL)
    survivor = 1 - victim
    assert result.codes[victim] == -signal.SIGKILL
    line = assert_one_message(result, r"rank \d: all_reduce .*over ranks \[0, 1\] failed at iteration \d+",
                              code=3, ranks=[survivor])
    if victim == 1:
        assert "rank(s) [1] did not answer" in line
    else:  # without torchrun rank 0 hosts the store the ranks would compare notes in
        assert "the job's rendezvous store does not answer either" in line
    assert after[survivor] < 10, after


def test_frozen_rank_in_tp2_dp2_is_named_within_the_timeout(corpus, tmp_path):
    """SIGSTOP'd rank 2 of TP 2 x DP 2: every survivor waits in a subgroup collective (TP or DP)
    and must give up after --distributed-timeout-minutes (here 0.1 = 6 s), not torch's 30-minute
    default for new groups; one of them names rank 2."""
    layout = ["--tensor-model-parallel-size", "2", "--distributed-timeout-minutes", "0.1"]
    result, after = _signal_a_rank(corpus, tmp_path, 4, 2, signal.SIGSTOP, layout)
    # the first survivor to time out exits; one that entered its collective later (a loaded machine)
    # then sees that peer close its connection before its own 6 s are up: either way rank 2 is named
    line = assert_one_message(result, r"failed at iteration \d+: (timed out after 6 s|a peer closed its "
                              r"connection)", code=3, ranks=[0, 1, 3])
    assert "rank(s) [2] did not answer" in line
    assert result.codes[2] is None  # still stopped: the test killed it
    assert max(after[r] for r in (0, 1, 3)) < 6 + 10, after


def _validation(text: str) -> dict[str, float]:
    return {where: float(value) for where, value in VALIDATION.findall(text)}


def test_resumed_run_validates_on_the_batches_of_the_uninterrupted_run(corpus, tmp_path):
    flags = _train(corpus, 8, "--eval-interval", "2", "--eval-iters", "2", "--save-interval", "4")
    straight = run_ranks_main(1, flags + ["--save", str(tmp_path / "a")], tmp_path / "a_log", timeout=120)
    assert straight.codes == [0], straight.describe()
    ckpt = str(tmp_path / "b")
    first = run_ranks_main(1, flags + ["--save", ckpt, "--exit-interval", "4"], tmp_path / "b_log1",
                           timeout=120)
    assert first.codes == [0], first.describe()
    resumed = run_ranks_main(1, flags + ["--save", ckpt, "--load", ckpt], tmp_path / "b_log2", timeout=120)
    assert resumed.codes == [0], resumed.describe()
    expected, got = _validation(straight.out[0]), _validation(resumed.out[0])
    assert sorted(got) == ["iteration 6", "iteration 8", "the end of training for val data"]
    assert {k: expected[k] for k in got} == got


@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_latest_checkpoint_by_itself(corpus, tmp_path):
    """torchrun --max-restarts 1, DP 2 with the distributed optimizer, checkpoints every 4 iterations:
    SIGKILL of one worker at iteration 6 restarts both; the second attempt loads iteration 4 from
    --save without being told and logs, from iteration 5 on, the losses and validation losses of a
    run that never stopped."""
    flags = _train(corpus, 10, "--global-batch-size", "4", "--use-distributed-optimizer", "--save-interval",
                   "4", "--eval-interval", "5", "--eval-iters", "2")
    straight = run_ranks_main(2, flags + ["--save", str(tmp_path / "a")], tmp_path / "a_log", timeout=180)
    assert straight.codes == [0, 0], straight.describe()

    ckpt, log_path = str(tmp_path / "b"), tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--save", ckpt]
    # The first attempt's ranks hold after iteration 6 (its line printed, iteration 8's save not
    # reached) until the kill: at ~10 ms an iteration, polling the log alone let the run finish first.
    hook = tmp_path / "hold"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_AFTER_ITERATION_6)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "iteration        6/" not in open(log_path).read():
            assert job.poll() is None and time.monotonic() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.1)
        workers = [int(p) for p in open(f"/proc/{job.pid}/task/{job.pid}/children").read().split()]
        os.kill(workers[1], signal.SIGKILL)
        assert job.wait(timeout=300) == 0, open(log_path).read()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = open(log_path).read()
    assert "Traceback" not in out
    resumed = out.split(f"loaded checkpoint from {ckpt} at iteration 4")
    assert len(resumed) == 2, out[-3000:]
    expected, got = losses(straight.out[1]), losses(resumed[1])
    assert sorted(got) == list(range(5, 11))
    assert [got[i] for i in got] == [expected[i] for i in got]
    expected_val, got_val = _validation(straight.out[1]), _validation(resumed[1])
    assert sorted(got_val) == ["iteration 10", "iteration 5", "the end of training for val data"]
    assert got_val == {k: expected_val[k] for k in got_val}


HOLD_AFTER_ITERATION_6 = """
import os
if "RANK" in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import time
    import megafab.training.pretrain as pretrain

    _step = pretrain.train_step

    def train_step(state, *args, **kwargs):
        if state.iteration == 6:
            time.sleep(600)
        return _step(state, *args, **kwargs)

    pretrain.train_step = train_step
"""


def _one_rank_errs_while_the_other_is_busy(rank):
    import time as clock

    import megafab.training.pretrain as pretrain
    from megafab.data.errors import DataError

    def stuck(*args, **kwargs):  # busy outside any collective (an NCCL wait never notices either)
        clock.sleep(600)

    def bad(*args, **kwargs):
        raise DataError("rank 1's shard of the data is bad", every_rank=False)

    pretrain.build_datasets = stuck if rank == 0 else bad


def test_a_rank_busy_elsewhere_is_ended_promptly_and_silently(corpus, tmp_path):
    """Rank 1 reports a user error while rank 0 is stuck in code that no collective failure will
    ever interrupt: rank 0's watcher ends it with rank 1's status a few seconds later, silently."""
    result = run_ranks_main(2, _train(corpus, 4), tmp_path, timeout=60,
                            before_main=_one_rank_errs_while_the_other_is_busy)
    assert_one_message(result, r"rank 1's shard of the data is bad")
    assert "rank 1's shard" in result.err[1] and result.elapsed[0] < 30, result.elapsed


def _internal_bug_on_rank_1(rank):
    import megafab.training.pretrain as pretrain

    if rank == 1:
        def broken(*args, **kwargs):
            raise KeyError("an internal bug")

        pretrain.build_datasets = broken


def test_an_internal_bug_keeps_its_traceback_and_the_other_ranks_stay_silent(corpus, tmp_path):
    result = run_ranks_main(2, _train(corpus, 4), tmp_path, timeout=60, before_main=_internal_bug_on_rank_1)
    assert result.codes[1] == 1 and "Traceback" in result.err[1], result.describe()
    assert "KeyError: 'an internal bug'" in result.err[1]
    assert result.codes[0] == 1 and result.err[0] == "", result.describe()
