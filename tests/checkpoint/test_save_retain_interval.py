"""--save-retain-interval (Megatron HEAD): each save to --save deletes the checkpoint the tracker named
before it unless that one's iteration is a multiple of the interval (or a symbolic link), so a run
keeps the multiples and the latest; synchronous and --async-save alike; Megatron's asserts as rules."""

from __future__ import annotations

import os

import pytest

from megafab.arguments import config_from_args
from megafab.checkpoint.directory import commit_checkpoint, iteration_dir
from megafab.config import ConfigError
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, write_corpus


def _saved(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("iter_") and not n.endswith(".tmp"))


def _commit(root, iteration, retain):
    os.makedirs(iteration_dir(root, iteration) + ".tmp")
    commit_checkpoint(root, iteration, retain)


def test_commit_retires_the_previous_checkpoint_unless_retained_or_linked(tmp_path):
    kept, every, linked = str(tmp_path / "kept"), str(tmp_path / "every"), str(tmp_path / "linked")
    for it in (2, 4, 6, 8, 10):
        _commit(kept, it, 4)
        _commit(every, it, None)
    assert _saved(kept) == [4, 8, 10] and _saved(every) == [2, 4, 6, 8, 10]
    _commit(linked, 2, 4)
    elsewhere = str(tmp_path / "elsewhere")
    os.rename(iteration_dir(linked, 2), elsewhere)
    os.symlink(elsewhere, iteration_dir(linked, 2))
    _commit(linked, 4, 4)
    assert os.path.islink(iteration_dir(linked, 2)) and os.path.isdir(elsewhere)  # a link is left alone


@pytest.mark.parametrize("extra", [[], ["--async-save", "--use-persistent-ckpt-worker"]],
                         ids=["sync", "async"])
def test_a_run_keeps_the_multiples_and_the_latest(extra, tmp_path):
    corpus, save = write_corpus(str(tmp_path / "corpus")), str(tmp_path / "save")
    flags = TINY + ["--train-iters", "6", "--data-path", corpus, "--split", "90,5,5", "--global-batch-size",
                    "1", "--save", save, "--save-interval", "1", "--save-retain-interval", "3", *extra]
    result = run_ranks_main(1, flags, tmp_path / "log", timeout=120)
    assert result.codes == [0], result.describe()
    assert _saved(save) == [3, 6]


@pytest.mark.parametrize("value,message", [
    ("0", "--save-retain-interval 0 must be positive"),
    ("3", "--save-retain-interval 3 is not a multiple of --save-interval 2"),
])
def test_megatrons_asserts_are_rules(value, message):
    flags = TINY + ["--train-iters", "4", "--mock-data", "--save", "s", "--save-interval", "2",
                    "--save-retain-interval", value]
    with pytest.raises(ConfigError, match=message):
        config_from_args(flags, world_size=1)
