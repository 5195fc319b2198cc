"""pretrain_gpt.py checkpoints end to end: exact resume after SIGKILL, a SIGKILL during a save,
resharding across TP/PP/DP layouts, and SIGTERM with --exit-signal-handler."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megafab.checkpoint.directory import latest_iteration
from tests.training.launch import ROOT, free_port, losses, torchrun

# NullTokenizer adds an eod id: 127 + 1 = 128 pads to 128 at TP 1, 2 and 4 alike.
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--num-workers", "0", "--mock-data", "--vocab-size", "127",
        "--make-vocab-size-divisible-by", "32", "--lr", "1e-2", "--lr-warmup-iters", "1",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1"]


# Rank 0 of a torchrun job pauses before committing the save of iteration 20 (the test kills the job
# there, while only the temporary directory exists); installed in the workers by the test.
PAUSE_BEFORE_COMMIT = """
import os
if os.environ.get("RANK") == "0":
    import time
    from megafab.checkpoint import checkpointing

    commit = checkpointing.commit_checkpoint

    def paused_commit(root, iteration):
        if iteration == 20:
            print(f"test hook: pause before committing iteration {iteration}", flush=True)
            time.sleep(600)
        return commit(root, iteration)

    checkpointing.commit_checkpoint = paused_commit
"""


def start(nproc: int, args: list[str], log_path, env: dict | None = None) -> subprocess.Popen:
    """torchrun in its own process group (so a test can SIGKILL the whole job), output to a file."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(ROOT, "pretrain_gpt.py"), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                            cwd=os.path.dirname(log_path), start_new_session=True)


def wait_for(proc: subprocess.Popen, log_path, text: str, timeout: float = 240) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = open(log_path).read()
        if text in out:
            return out
        if proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) before printing {text!r}:\n{out[-3000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no {text!r} within {timeout} s:\n{open(log_path).read()[-3000:]}")


def workers_of(proc: subprocess.Popen) -> list[int]:
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        return [int(pid) for pid in f.read().split()]


@pytest.mark.slow
def test_resume_after_sigkill_and_a_kill_during_save_matches_the_straight_run(tmp_path, startup_hook):
    """DP2 with the distributed optimizer and dropout on (so RNG restore matters).

    One job trains 20 iterations straight, saving at 10 and 20; a test hook pauses it inside the
    save of iteration 20, after every rank has written its files into iter_0000020.tmp and
    before the rename, and SIGKILL to the whole process group lands there. A second job resumes
    with --load: it must start from 10 (the last complete checkpoint) and log the same losses for
    11-20 as the job that never stopped.
    """
    args = TINY + ["--global-batch-size", "4", "--train-iters", "20", "--use-distributed-optimizer"]
    ckpt = str(tmp_path / "ckpt")
    save = ["--save", ckpt, "--save-interval", "10"]
    job = start(2, args + save, tmp_path / "killed.log", env=startup_hook(PAUSE_BEFORE_COMMIT))
    out = wait_for(job, tmp_path / "killed.log", "test hook: pause before committing iteration 20")
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    expected = losses(out)
    assert sorted(expected) == list(range(1, 21))
    assert latest_iteration(ckpt) == 10
    assert os.path.isdir(os.path.join(ckpt, "iter_0000020.tmp"))  # the interrupted save
    assert not os.path.exists(os.path.join(ckpt, "iter_0000020"))

    resumed = torchrun(2, args + save + ["--load", ckpt], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"loaded checkpoint from {ckpt} at iteration 10" in resumed.stdout
    got = losses(resumed.stdout)
    assert sorted(got) == list(range(11, 21))
    assert [got[i] for i in range(11, 21)] == [expected[i] for i in range(11, 21)]
    assert latest_iteration(ckpt) == 20
    assert sorted(os.listdir(ckpt)) == ["iter_0000010", "iter_0000020", "latest_checkpointed_iteration.txt",
                                        "metrics.jsonl", "resolved_config.toml"]  # the stale .tmp is gone


def _close(got: dict, expected: dict, iters) -> None:
    for it in iters:
        assert abs(got[it] - expected[it]) <= 1e-5 * abs(expected[it]), (it, got[it], expected[it])


@pytest.mark.slow
def test_checkpoint_of_tp2_pp2_dp2_loads_into_tp1_and_tp4_dp2(tmp_path):
    """Saved at iteration 3 by TP2 x PP2 (VPP2) x DP2 + SP + distributed optimizer with SwiGLU
    (stride-2 fc1) and tied embeddings; the next two iterations (4: weights; 5: also the Adam
    state) log the original layout's losses in one process and at TP4 x DP2."""
    model = TINY + ["--global-batch-size", "8", "--train-iters", "5", "--hidden-dropout", "0",
                    "--attention-dropout", "0", "--swiglu", "--ffn-hidden-size", "64"]
    ckpt = str(tmp_path / "ckpt")
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "1", "--sequence-parallel",
              "--use-distributed-optimizer"]
    original = torchrun(8, model + layout + ["--save", ckpt, "--save-interval", "3"], cwd=tmp_path)
    assert original.returncode == 0, original.stdout[-3000:] + original.stderr[-3000:]
    expected = losses(original.stdout)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")  # pick the iteration-3 checkpoint (the run also saved 5 at its end)

    single = torchrun(1, model + ["--load", ckpt], cwd=tmp_path)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    assert "RNG states are per rank, so they are not restored" in single.stdout
    got = losses(single.stdout)
    assert sorted(got) == [4, 5]
    _close(got, expected, [4, 5])

    tp4 = torchrun(8, model + ["--tensor-model-parallel-size", "4", "--sequence-parallel",
                               "--use-distributed-optimizer", "--load", ckpt], cwd=tmp_path)
    assert tp4.returncode == 0, tp4.stdout[-3000:] + tp4.stderr[-3000:]
    got = losses(tp4.stdout)
    assert sorted(got) == [4, 5] and "tp 4 pp 1 dp 2" in tp4.stdout
    _close(got, expected, [4, 5])


@pytest.mark.slow
def test_sigterm_with_exit_signal_handler_saves_and_exits_zero(tmp_path):
    """SLURM preemption sends SIGTERM to the ranks; here one rank gets it, every rank must stop
    at the same iteration, save it and leave with exit code 0."""
    ckpt = str(tmp_path / "ckpt")
    args = TINY + ["--global-batch-size", "2", "--train-iters", "100000", "--exit-signal-handler",
                   "--save", ckpt]
    job = start(2, args, tmp_path / "job.log")
    wait_for(job, tmp_path / "job.log", "iteration        3/")
    os.kill(workers_of(job)[-1], signal.SIGTERM)
    assert job.wait(timeout=120) == 0, open(tmp_path / "job.log").read()[-3000:]
    out = open(tmp_path / "job.log").read()
    stopped = int(out.split("exiting at iteration ")[1].split(":")[0])
    assert "SIGTERM received" in out and stopped >= 3
    assert latest_iteration(ckpt) == stopped
    assert max(losses(out)) == stopped
    assert os.path.isfile(os.path.join(ckpt, f"iter_{stopped:07d}", "metadata.json"))
