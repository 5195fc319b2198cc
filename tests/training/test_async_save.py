"""--async-save (issue 40): the checkpoint an asynchronous save writes is the synchronous save's, byte
for byte in its tensor files; the run that resumes from it trains on the losses of the uninterrupted
run; a failed background write (a full disk) ends the job with one message naming the directory,
and the previous checkpoint stays the latest."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.checkpoint import megatron_dist
from megafab.plan.state_memory import state_bytes
from tests.helpers.launch import losses
from tests.helpers.main_ranks import run_ranks_main, start_ranks, wait_for_text
from tests.helpers.tiny_corpus import TINY, assert_one_message, write_corpus

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="these tests fork their ranks")
ASYNC = ["--async-save", "--use-persistent-ckpt-worker"]
TRACKER = "latest_checkpointed_iteration.txt"


def _flags(corpus, iters, save, *extra):
    # The schedule spans 6 iterations whatever --train-iters: a run of 4 resumes into the run of 6.
    return TINY + ["--train-iters", str(iters), "--lr-decay-iters", "6", "--data-path", corpus, "--split",
                   "90,5,5", "--global-batch-size", "2", "--use-distributed-optimizer",
                   "--save-interval", "2",
                   "--save", save, *extra]


def _run(flags, log):
    result = run_ranks_main(2, flags, log, timeout=120)
    assert result.codes == [0, 0], result.describe()
    return "".join(result.out)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted synchronous run of 6 iterations, DP 2 + distributed optimizer."""
    root = tmp_path_factory.mktemp("straight")
    corpus = write_corpus(str(root / "good"))
    out = _run(_flags(corpus, 6, str(root / "sync")), root / "log")
    return corpus, str(root / "sync"), losses(out)


def _read(path):
    return open(path, "rb").read()


def test_async_checkpoint_is_the_sync_one_and_resumes_exactly(straight, tmp_path):
    corpus, sync, want = straight
    save = str(tmp_path / "async")
    out = _run(_flags(corpus, 4, save, *ASYNC), tmp_path / "a")
    assert "scheduled an async checkpoint save at iteration       4" in out
    assert "saved checkpoint at iteration       4" in out and "stalled training" in out
    assert open(os.path.join(save, TRACKER)).read() == "4"
    mine, theirs = os.path.join(save, "iter_0000004"), os.path.join(sync, "iter_0000004")
    assert sorted(os.listdir(mine)) == sorted(os.listdir(theirs))
    for name in ("__0_0.distcp", "__1_0.distcp", megatron_dist.METADATA_JSON):
        assert _read(os.path.join(mine, name)) == _read(os.path.join(theirs, name)), name
    a, b = megatron_dist.TorchDistSource(mine), megatron_dist.TorchDistSource(theirs)
    assert {k: (tuple(v.size), v.properties.dtype) for k, v in a.stored.items()} == \
        {k: (tuple(v.size), v.properties.dtype) for k, v in b.stored.items()}
    common = megatron_dist.read_common(mine)
    assert common["iteration"] == 4
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert a.counters == b.counters
    ours, ref = a.read_all(), b.read_all()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)
    # the run record: each async save's stall and host staging (the most any rank staged) in metrics.jsonl
    records = [json.loads(line) for line in open(os.path.join(save, "metrics.jsonl"))]
    saves = {r["iteration"]: r for r in records if r["kind"] == "async_save"}
    assert sorted(saves) == [2, 4] and all(r["stall_s"] >= 0 for r in saves.values())
    staged = saves[4]["staged_bytes_max_per_rank"]
    params = int(out.split(" > parameters per pipeline stage: stage 0: ")[1].split(" ")[0].replace(",", ""))
    planned = state_bytes(config_from_args(_flags(corpus, 4, save, *ASYNC), world_size=2), params, 0)
    assert staged == saves[2]["staged_bytes_max_per_rank"] and abs(staged - planned.staging) <= 64, \
        (staged, planned.staging)  # fp32 weights + Adam's two moments, over DP 2 (odd sizes padded)
    assert f"at most {staged / 2**20:.1f} MiB on a rank" in out

    resumed = _run(_flags(corpus, 6, save, *ASYNC, "--load", save), tmp_path / "b")
    assert "loaded checkpoint from" in resumed and "at iteration 4" in resumed
    got = losses(resumed)
    assert sorted(want) == [1, 2, 3, 4, 5, 6] and sorted(got) == [5, 6]
    assert all(got[i] == want[i] for i in got), (got, want)
    assert open(os.path.join(save, TRACKER)).read() == "6"

    # resharded as a synchronous save is: DP 2's async checkpoint of iteration 4 into one rank
    flags = _flags(corpus, 5, str(tmp_path / "dp1"), "--load", os.path.join(save, "iter_0000004"))
    flags = [f for f in flags if f != "--use-distributed-optimizer"]
    one = run_ranks_main(1, flags, tmp_path / "c", timeout=120)
    assert one.codes == [0], one.describe()
    assert "at iteration 4" in one.out[0] and sorted(losses(one.out[0])) == [5], one.out[0][-2000:]


def _mount_tmpfs(path, size: int) -> bool:
    os.makedirs(path)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _size(directory) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def test_a_full_disk_in_the_background_write_is_one_message_and_the_last_checkpoint_stays(straight, tmp_path):
    corpus, sync, _ = straight
    one = _size(os.path.join(sync, "iter_0000002"))
    disk = str(tmp_path / "disk")
    # room for the first checkpoint, its run files and the second's small files, not its tensors
    if not _mount_tmpfs(disk, int(one * 1.4)):
        pytest.skip("needs a tiny tmpfs (mount as root) to fill a disk during the background write")
    try:
        result = run_ranks_main(2, _flags(corpus, 4, disk, *ASYNC), tmp_path / "log", timeout=120)
        line = assert_one_message(result, r"writing the checkpoint files into .*iter_0000004\.tmp failed on "
                                          r"rank \d \((OSError|RuntimeError).*"
                                          r"(No space left on device|the disk is full)")
        assert "iteration 2 stays the latest" in line, line
        assert open(os.path.join(disk, TRACKER)).read() == "2"
        megatron_dist.TorchDistSource(os.path.join(disk, "iter_0000002")).read_all()  # loads whole
    finally:
        subprocess.run(["umount", "-l", disk], capture_output=True, timeout=30)


def test_sigterm_with_a_save_pending_saves_and_finalizes_before_exiting(straight, tmp_path):
    """--exit-signal-handler: the exit's save waits for the pending one, and is finalized itself."""
    corpus, _, _ = straight
    save = str(tmp_path / "ckpt")
    flags = _flags(corpus, 100000, save, *ASYNC, "--exit-signal-handler")
    with start_ranks(2, flags, tmp_path / "log") as job:
        wait_for_text(job, 0, "scheduled an async checkpoint save at iteration       2", timeout=60)
        for pid in job.pids:
            os.kill(pid, signal.SIGTERM)
        result = job.wait(timeout=60)
    assert result.codes == [0, 0], result.describe()
    out = result.out[0]
    stopped = int(out.split("exiting at iteration")[1].split(":")[0])
    assert f"saved checkpoint at iteration {stopped:7d}" in out
    assert open(os.path.join(save, TRACKER)).read() == str(stopped)
    assert [d for d in os.listdir(save) if d.endswith(".tmp")] == []
    last = megatron_dist.TorchDistSource(os.path.join(save, f"iter_{stopped:07d}"))
    assert last.counters.iteration == stopped
