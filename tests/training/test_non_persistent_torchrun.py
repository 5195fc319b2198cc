"""Local non-persistent checkpoints under torchrun --max-restarts (issue 40): a job saving
persistently every 10 and to node-local storage every 2 iterations, one of whose workers is SIGKILLed
once iteration 7 is done, is restarted by torchrun by itself and resumes from the local checkpoint of
iteration 6, on the losses of a run that never stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.child_hooks import startup_hook_env
from tests.helpers.launch import ROOT, free_port, losses
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, write_corpus

# The first attempt's rank 1 kills itself after iteration 7's step (a crashed node); the restart runs on.
DIE_AFTER_ITERATION_7 = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import signal
    import megafab.training.pretrain as pretrain

    _step = pretrain.train_step

    def train_step(state, *args, **kwargs):
        out = _step(state, *args, **kwargs)
        if state.iteration == 7:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    pretrain.train_step = train_step
"""


@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_local_checkpoint_of_iteration_6(tmp_path):
    corpus = write_corpus(str(tmp_path / "good"))
    plain = TINY + ["--train-iters", "8", "--data-path", corpus, "--split", "90,5,5", "--global-batch-size",
                    "2", "--use-distributed-optimizer"]
    straight = run_ranks_main(2, plain, tmp_path / "straight", timeout=120)
    assert straight.codes == [0, 0], straight.describe()
    save, local = str(tmp_path / "ckpt"), str(tmp_path / "node_local")
    flags = plain + ["--save", save, "--save-interval", "10", "--non-persistent-save-interval", "2",
                     "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", local]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(ROOT, "pretrain_gpt.py"), *flags]
    env = startup_hook_env(tmp_path / "hook", DIE_AFTER_ITERATION_7, {**os.environ, "OMP_NUM_THREADS": "1"})
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while job.poll() is None:
            assert time.monotonic() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.2)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = open(log_path).read()
    assert job.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    first, _, restart = out.partition("loading the non-persistent checkpoint of iteration 6")
    assert restart, out[-3000:]
    assert "iteration        6/" in first and "iteration        8/" not in first  # died at 7
    got, want = losses(restart), losses(straight.out[1])
    assert sorted(got) == [7, 8] and all(got[i] == want[i] for i in got), (got, want)
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "8"
