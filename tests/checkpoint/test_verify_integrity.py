"""--verify-integrity (Megatron HEAD): a torch_dist save writes integrity.json (SHA-256 of every file
directly in the checkpoint directory) byte for byte as Megatron's save_integrity_manifest writes it
(fixtures/integrity_megatron_head: a stand-in checkpoint directory and the manifest Megatron-LM
d98e8a64dd's validation.save_integrity_manifest wrote for it, subdirectories left out); a load with
the flag re-checks the files first: a damaged file, a missing one or a checkpoint saved without the
manifest stops the run with one message (exit 2) naming it; without the flag nothing is checked."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from megafab.arguments import config_from_args
from megafab.checkpoint.integrity import MANIFEST, manifest_problem, write_manifest
from megafab.config import ConfigError
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, assert_one_message, write_corpus

HEAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "integrity_megatron_head")


def test_the_manifest_is_megatrons_and_megatrons_verifies(tmp_path):
    mine = str(tmp_path / "ckpt")
    shutil.copytree(HEAD, mine)
    os.remove(os.path.join(mine, MANIFEST))
    write_manifest(mine)
    assert open(os.path.join(mine, MANIFEST)).read() == open(os.path.join(HEAD, MANIFEST)).read()
    assert manifest_problem(HEAD) is None


def _flags(tmp_path, iters, *extra):
    corpus = write_corpus(str(tmp_path / "corpus"))
    return TINY + ["--train-iters", str(iters), "--lr-decay-iters", "4", "--data-path", corpus, "--split",
                   "90,5,5", "--global-batch-size", "1", "--save-interval", "2", *extra]


def _run(flags, log, code=0):
    result = run_ranks_main(1, flags, log, timeout=120)
    if code == 0:
        assert result.codes == [0], result.describe()
    return result


def test_a_save_records_its_files_and_a_load_checks_them(tmp_path):
    save = str(tmp_path / "save")
    _run(_flags(tmp_path, 2, "--save", save, "--verify-integrity"), tmp_path / "a")
    ckpt = os.path.join(save, "iter_0000002")
    manifest = json.load(open(os.path.join(ckpt, MANIFEST)))
    top = sorted(n for n in os.listdir(ckpt) if os.path.isfile(os.path.join(ckpt, n)) and n != MANIFEST)
    assert manifest["algorithm"] == "sha256" and sorted(manifest["files"]) == top
    assert any(n.endswith(".distcp") for n in top) and "metadata.json" in top
    for name, digest in manifest["files"].items():
        assert hashlib.sha256(open(os.path.join(ckpt, name), "rb").read()).hexdigest() == digest
    resume = _flags(tmp_path, 4, "--save", save, "--load", save, "--verify-integrity")
    _run(resume, tmp_path / "b")  # intact: resumes and trains on
    assert json.load(open(os.path.join(save, "iter_0000004", MANIFEST)))["files"]
    # damage one byte of a tensor file of the latest checkpoint
    latest = os.path.join(save, "iter_0000004")
    shard = sorted(n for n in os.listdir(latest) if n.endswith(".distcp"))[0]
    with open(os.path.join(latest, shard), "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    again = _flags(tmp_path, 6, "--save", save, "--load", save, "--verify-integrity")
    result = _run(again, tmp_path / "c", code=2)
    assert_one_message(result, rf"--verify-integrity: 1 file\(s\) of .*iter_0000004 differ from "
                               rf"integrity.json: {shard} has SHA-256")


def test_a_checkpoint_without_a_manifest_is_named(tmp_path):
    save = str(tmp_path / "save")
    _run(_flags(tmp_path, 2, "--save", save), tmp_path / "a")
    result = _run(_flags(tmp_path, 4, "--load", save, "--verify-integrity"), tmp_path / "b", code=2)
    assert_one_message(result, r"integrity.json does not exist: the checkpoint was saved without "
                               r"--verify-integrity")


def test_megatrons_rule_torch_dist_only():
    with pytest.raises(ConfigError, match="--verify-integrity works only with --ckpt-format torch_dist"):
        config_from_args(TINY + ["--train-iters", "2", "--mock-data", "--verify-integrity", "--ckpt-format",
                                 "torch", "--save", "s", "--no-save-optim"], world_size=1)
