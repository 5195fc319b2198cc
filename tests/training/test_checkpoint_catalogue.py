"""The checkpoint part of the error catalogue (issue 18): every damaged or mismatched checkpoint
ends the job with one message naming the file and the fix, exit 2, no traceback, no hang; --load of
an iter_N directory loads that iteration; --save under a regular file is refused at start-up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT, free_port, losses
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, assert_one_message, write_corpus

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the catalogue forks its ranks")
TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A DP 2 torch_dist checkpoint of iteration 2 (two .distcp shards, two RNG files) and its corpus."""
    root = tmp_path_factory.mktemp("saved")
    corpus = write_corpus(str(root / "good"))
    flags = _train(corpus, 2) + ["--save", str(root / "ckpt")]
    result = run_ranks_main(2, flags, root / "log", timeout=120)
    assert result.codes == [0, 0], result.describe()
    return corpus, str(root / "ckpt")


def _train(corpus, iters):
    # The schedule spans 4 iterations whatever --train-iters, so runs of 4 resume the saved run of 2.
    return TINY + ["--train-iters", str(iters), "--lr-decay-iters", "4", "--data-path", corpus,
                   "--split", "90,5,5", "--global-batch-size", "2"]


def _copy(saved, tmp_path) -> str:
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved[1], ckpt)
    return ckpt


def _write(path, data):
    with open(path, "w") as f:
        f.write(data)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


I2 = "iter_0000002"
DAMAGE = {
    "tracker holds garbage": (lambda c: _write(os.path.join(c, TRACKER), "garbage\n"),
                              rf"{TRACKER} holds 'garbage', not an iteration number"),
    "tracker names a missing iteration": (lambda c: _write(os.path.join(c, TRACKER), "9"),
                                          r"names iteration 9 but .*iter_0000009 does not exist"),
    "missing .distcp shard": (lambda c: os.remove(os.path.join(c, I2, "__1_0.distcp")),
                              rf"{I2} is incomplete: .*__1_0\.distcp are missing"),
    "truncated .distcp shard": (lambda c: _truncate(os.path.join(c, I2, "__0_0.distcp")),
                                rf"{I2}/__0_0\.distcp: \d+ bytes, but \.metadata places tensors up to byte"),
    "deleted .metadata": (lambda c: os.remove(os.path.join(c, I2, ".metadata")),
                          rf"{I2} has no \.metadata"),
    "deleted RNG file": (lambda c: os.remove(os.path.join(c, I2, "rng", "rank_00001.pt")),
                         r"rank_00001\.pt: missing, so rank 1's random state cannot be restored"),
    "truncated common.pt": (lambda c: _truncate(os.path.join(c, I2, "common.pt")),
                            rf"{I2}/common\.pt could not be read as a torch file"),
    "deleted metadata.json": (lambda c: os.remove(os.path.join(c, I2, "metadata.json")),
                              r"holds DCP files without metadata\.json and without `model\.` weights: "
                              r"not Megatron's fsdp_dtensor"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_checkpoint(saved, tmp_path, case):
    damage, message = DAMAGE[case]
    ckpt = _copy(saved, tmp_path)
    damage(ckpt)
    result = run_ranks_main(2, _train(saved[0], 4) + ["--load", ckpt], tmp_path / "log", timeout=120)
    assert_one_message(result, message)
    if case == "deleted RNG file":
        assert "rank_00001.pt: missing" in result.err[1]  # the rank that saw it speaks


def test_checkpoint_of_another_model_shape_names_the_flags_not_the_vocabulary(saved, tmp_path):
    flags = _train(saved[0], 4) + ["--load", saved[1], "--hidden-size", "64"]
    result = run_ranks_main(2, flags, tmp_path, timeout=120)
    assert_one_message(result, r"iter_0000002 was saved from a different model than this run builds:")
    message = result.err[0].split("megafab: error: ")[1]  # one line per differing flag under it
    assert "\n  --hidden-size: checkpoint 32, this run 64\n" in message, message
    assert "vocab" not in message  # the vocabulary is not what differs


def test_load_of_an_iteration_directory_loads_that_iteration(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    result = run_ranks_main(2, _train(saved[0], 4) + ["--load", os.path.join(ckpt, I2)], tmp_path / "log",
                            timeout=120)
    assert result.codes == [0, 0], result.describe()
    assert f"names one checkpoint; loading iteration 2 of {ckpt}" in result.out[0]
    assert sorted(losses(result.out[1])) == [3, 4]


def test_save_under_a_regular_file_is_refused_at_start_up(saved, tmp_path):
    (tmp_path / "a_file").write_text("")
    flags = _train(saved[0], 4) + ["--save", str(tmp_path / "a_file" / "ckpt")]
    result = run_ranks_main(2, flags, tmp_path / "log", timeout=60)
    assert_one_message(result, r"--save .*a_file/ckpt: .*a_file is a file, not a directory")
    assert not any("iteration" in out for out in result.out)


def test_generate_refuses_an_out_of_vocabulary_prompt_id(saved, capsys):
    from tools.generate import main

    assert main(["--load", saved[1], "--prompt", "5 999 7", "--greedy", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    # the checkpoint read's one progress line (off a terminal), then the one error line
    lines = [line for line in err.splitlines() if not line.startswith("reading ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("megafab: error: prompt token id(s) [999] are outside the model's vocabulary "
                               "0..127")


@pytest.mark.slow
def test_torchrun_summary_names_the_rank_that_reported(saved, tmp_path):
    """Under torchrun the speaking rank writes torch elastic's error file: the failure summary's
    root cause is rank 1 with megafab's message, not a silent rank or a traceback."""
    ckpt = _copy(saved, tmp_path)
    os.remove(os.path.join(ckpt, I2, "rng", "rank_00001.pt"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"),
           *_train(saved[0], 4), "--load", ckpt]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode != 0
    root_cause = run.stderr.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "exitcode  : 2" in root_cause, root_cause
    assert "megafab: error: " in root_cause and "rank_00001.pt: missing" in root_cause, root_cause
    assert run.stderr.count("megafab: error:") == 1 + run.stderr.count("traceback : megafab: error:")
