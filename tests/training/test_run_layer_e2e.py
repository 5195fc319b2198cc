"""The run layer on real jobs (issue 27): a flag's missing optional package stops every rank at
start-up with one message; a rank's own failure (a DataLoader worker that timed out) is not blamed
on a peer; under torchrun a configuration error is printed once, plus torchrun's root cause."""

from __future__ import annotations

import os
import re

import pytest

from tests.helpers.child_hooks import hide_packages
from tests.helpers.launch import torchrun
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, assert_one_message, error_lines

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="these tests fork their ranks")
STARTED = "process(es), tp"  # rank 0's first line once the process groups exist


def _hiding(*names):
    return lambda rank: hide_packages(*names)


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_missing_optional_package_stops_every_rank_before_the_process_groups(tmp_path, nproc):
    flags = TINY + ["--mock-data", "--train-iters", "2", "--tensorboard-dir", str(tmp_path / "tb")]
    if nproc == 4:
        flags += ["--wandb-project", "megafab-test"]
    result = run_ranks_main(nproc, flags, tmp_path / "log", timeout=60,
                            before_main=_hiding("tensorboard", "wandb"))
    line = assert_one_message(result, r"--tensorboard-dir needs the tensorboard package")
    assert "pip install megafab[tensorboard]" in line
    if nproc == 4:  # both flags in the same one message
        assert "--wandb-project needs the wandb package" in line and "pip install megafab[wandb]" in line
    everything = "".join(result.out + result.err)
    assert STARTED not in everything and "parameters" not in everything, result.describe()
    assert max(result.elapsed) < 30, result.elapsed  # no rank waited for another


def _slow_data_on_rank_1(rank):
    """Rank 1's DataLoader gives up after 2 s (timeout=2); its worker takes 60 s from the third
    micro-batch on (the first two arrive in time)."""
    if rank != 1:
        return
    import time

    import torch

    loader = torch.utils.data.DataLoader

    class Slow(torch.utils.data.Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, index):
            if index >= 4:  # rank 1 of DP 2 reads samples 1, 3, 5, ...
                time.sleep(60)
            return self.inner[index]

    class TimingOut(loader):
        def __init__(self, dataset, **kwargs):
            super().__init__(Slow(dataset), **{**kwargs, "timeout": 2})

    torch.utils.data.DataLoader = TimingOut


def test_a_dataloader_timeout_is_this_ranks_error_not_a_peers_fault(tmp_path, mock_data_cache):
    flags = TINY + mock_data_cache + ["--mock-data", "--train-iters", "6", "--num-workers", "1",
                                      "--eval-iters", "0"]
    result = run_ranks_main(2, flags, tmp_path, timeout=90, before_main=_slow_data_on_rank_1)
    assert "DataLoader timed out after 2 seconds" in result.err[1], result.describe()
    assert "Traceback" in result.err[1]  # not a user error: its traceback, on the rank that had it
    assert result.codes == [1, 1], result.describe()  # 3 would say a peer died or froze
    assert error_lines(result) == [], result.describe()  # no fault report, nobody blamed
    assert result.err[0] == "", result.describe()  # the other rank stops without a word


def test_torchrun_prints_a_configuration_error_once_plus_its_root_cause(tmp_path):
    flags = TINY + ["--mock-data", "--train-iters", "2", "--num-attention-heads", "3"]
    rule = "--hidden-size 32 is not divisible by --num-attention-heads 3"
    result = torchrun(4, flags, timeout=240, cwd=str(tmp_path))
    everything = result.stdout + result.stderr
    assert result.returncode != 0
    assert everything.count(rule) == 2, everything[-6000:]  # megafab's message, torchrun's root cause
    root_cause = everything.split("Root Cause (first observed failure):")[1]
    assert rule in root_cause and "exitcode  : 2" in root_cause, everything[-6000:]
    assert not re.search(r'File ".*megafab/', everything), everything[-6000:]  # torchrun's own only


def _rank_1_exits_while_rank_0_is_busy(rank):
    import sys
    import time

    import megafab.training.pretrain as pretrain

    def busy(*args, **kwargs):  # outside any collective: no failure would ever wake it
        time.sleep(600)

    def leave(*args, **kwargs):
        sys.exit(4)

    pretrain.build_datasets = busy if rank == 0 else leave


def test_a_ranks_system_exit_ends_the_others_with_its_status(tmp_path):
    result = run_ranks_main(2, TINY + ["--mock-data", "--train-iters", "2"], tmp_path, timeout=60,
                            before_main=_rank_1_exits_while_rank_0_is_busy)
    assert result.codes == [4, 4], result.describe()
    assert result.elapsed[0] < 30, result.elapsed  # the watcher ended rank 0 within its grace period
    assert result.err[0] == "", result.describe()
