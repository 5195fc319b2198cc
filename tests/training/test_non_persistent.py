"""Global non-persistent checkpoints (issue 40, Megatron's --non-persistent-save-interval with
--non-persistent-ckpt-type global): a run saving persistently every 10 and non-persistently every 2
iterations, killed at iteration 7, resumes on restart from the non-persistent checkpoint of
iteration 6 on the losses of the uninterrupted run, from SAVE/non_persistent (global) or the
node-local directory (local); with that directory removed it starts from scratch and says so; older
non-persistent checkpoints are removed as Megatron does; in_memory is refused by name."""

from __future__ import annotations

import os
import shutil

import pytest

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from tests.helpers.flags import tiny_flags
from tests.helpers.launch import losses
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, assert_one_message, write_corpus

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="these tests fork their ranks")
TRACKER = "latest_checkpointed_iteration.txt"
RESTARTED = {"TORCHELASTIC_RESTART_COUNT": "1"}  # what torchrun --max-restarts sets on a restart


def _flags(corpus, save, kind, *extra):
    where = ["--non-persistent-local-ckpt-dir", os.path.join(save, "..", "local")] if kind == "local" else []
    return TINY + ["--train-iters", "8", "--data-path", corpus, "--split", "90,5,5", "--global-batch-size",
                   "2", "--use-distributed-optimizer", "--save", save, "--save-interval", "10",
                   "--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", kind, *where, *extra]


def _die_at_iteration_7(rank: int) -> None:
    """before_main: the rank kills itself (SIGKILL) once iteration 7 is done, as a crashed node."""
    import signal

    from megafab.training import pretrain

    step = pretrain.train_step

    def step_then_die(state, *args, **kwargs):
        out = step(state, *args, **kwargs)
        if state.iteration == 7:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    pretrain.train_step = step_then_die


def _run(flags, log, **kwargs):
    result = run_ranks_main(2, flags, log, timeout=120, **kwargs)
    return result, "".join(result.out)


@pytest.mark.parametrize("kind", ["global", "local"])
def test_a_restart_resumes_from_the_newest_non_persistent_checkpoint(tmp_path, kind):
    corpus = write_corpus(str(tmp_path / "good"))
    plain = TINY + ["--train-iters", "8", "--data-path", corpus, "--split", "90,5,5", "--global-batch-size",
                    "2", "--use-distributed-optimizer"]
    _, straight = _run(plain, tmp_path / "straight")
    want = losses(straight)
    save = str(tmp_path / "ckpt")
    killed, _ = _run(_flags(corpus, save, kind), tmp_path / "killed", before_main=_die_at_iteration_7)
    assert killed.codes == [-9, -9], killed.describe()
    kept = os.path.join(save, "non_persistent") if kind == "global" else os.path.join(save, "..", "local")
    assert not os.path.exists(os.path.join(save, TRACKER))  # no persistent checkpoint yet
    assert open(os.path.join(kept, TRACKER)).read() == "6"
    # Megatron's cleanup: before a save, all but the newest go (iteration 2 went when 6 started)
    assert sorted(d for d in os.listdir(kept) if d.startswith("iter_")) == ["iter_0000004", "iter_0000006"]

    result, out = _run(_flags(corpus, save, kind), tmp_path / "restart", env=RESTARTED)
    assert result.codes == [0, 0], result.describe()
    assert "loading the non-persistent checkpoint of iteration 6" in out
    got = losses(out)
    assert sorted(got) == [7, 8] and all(got[i] == want[i] for i in got), (got, want)
    assert open(os.path.join(save, TRACKER)).read() == "8"  # the end of training saves persistently

    shutil.rmtree(kept)
    shutil.rmtree(os.path.join(save, "iter_0000008"))
    os.remove(os.path.join(save, TRACKER))
    result, out = _run(_flags(corpus, save, kind, "--train-iters", "2"), tmp_path / "gone", env=RESTARTED)
    assert result.codes == [0, 0], result.describe()
    assert "nor in its non-persistent directory; training from scratch" in out
    got = losses(out)
    assert sorted(got) == [1, 2] and all(got[i] == want[i] for i in got), (got, want)


BASE = tiny_flags(num_layers=2) + ["--micro-batch-size", "1", "--train-iters", "1", "--mock-data",
                                   "--vocab-size", "64", "--lr", "1e-3", "--save", "s"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--non-persistent-ckpt-type", "local"], "--non-persistent-ckpt-type local needs "
                                              "--non-persistent-local-ckpt-dir"),
    (["--non-persistent-ckpt-type", "in_memory"], "--non-persistent-ckpt-type in_memory: checkpoints kept in "
                                                  "memory"),
    (["--non-persistent-save-interval", "2"],
     "--non-persistent-save-interval needs --non-persistent-ckpt-type"),
    (["--non-persistent-ckpt-type", "global", "--ckpt-format", "torch", "--no-save-optim"],
     "--non-persistent-ckpt-type global writes torch_dist checkpoints"),
])
def test_non_persistent_flags_megafab_lacks_are_refused_by_name(extra, message):
    with pytest.raises(ConfigError, match=message):
        config_from_args(BASE + extra, world_size=1)


def _tracker(root, iteration):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))


def test_the_load_takes_the_newer_of_the_two_and_says_which(tmp_path):
    from megafab.checkpoint.non_persistent import choose_load_dir

    load = str(tmp_path / "ckpt")
    flags = BASE + ["--load", load, "--non-persistent-ckpt-type", "global"]
    ck = config_from_args(flags, world_size=1).checkpoint
    _tracker(load, 10)
    note = f"the non-persistent checkpoint directory {load}/non_persistent holds none"
    assert choose_load_dir(ck, load) == (load, f"{note}: loading iteration 10 of --load {load}")
    _tracker(os.path.join(load, "non_persistent"), 8)
    assert choose_load_dir(ck, load)[0] == load and "holds iteration 8, older" in choose_load_dir(ck, load)[1]
    _tracker(os.path.join(load, "non_persistent"), 10)  # Megatron: the non-persistent one when as new
    assert choose_load_dir(ck, load)[0] == os.path.join(load, "non_persistent")


def _two_hosts(rank: int) -> None:
    import socket

    socket.gethostname = lambda: f"node{rank}"


def test_local_checkpoints_across_nodes_are_refused_with_one_message(tmp_path):
    corpus = write_corpus(str(tmp_path / "good"))
    flags = _flags(corpus, str(tmp_path / "ckpt"), "local")
    result, _ = _run(flags, tmp_path / "log", before_main=_two_hosts)
    assert_one_message(result, r"--non-persistent-ckpt-type local with ranks on 2 hosts")
