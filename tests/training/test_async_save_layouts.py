"""--async-save writes the synchronous save's torch_dist files in every layout (issue 40): the same
file names and byte-identical DCP tensor files under PP 2, TP 2 + SP, FSDP2 with bf16, and MoE
with EP 2 and the distributed optimizer (2 ranks each)."""

from __future__ import annotations

import filecmp
import os

import pytest

from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, write_corpus

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="these tests fork their ranks")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "good"))


LAYOUTS = {
    "PP 2": ["--pipeline-model-parallel-size", "2"],
    "TP 2 + SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "FSDP2 bf16": ["--use-torch-fsdp2", "--bf16"],
    "MoE EP 2": ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                 "--use-distributed-optimizer"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_async_and_sync_saves_write_the_same_files(corpus, tmp_path, layout):
    flags = TINY + ["--train-iters", "2", "--data-path", corpus, "--split", "90,5,5", "--global-batch-size",
                    "2", "--save-interval", "2", *LAYOUTS[layout]]
    for name, extra in (("sync", []), ("async", ["--async-save", "--use-persistent-ckpt-worker"])):
        result = run_ranks_main(2, flags + ["--save", str(tmp_path / name), *extra], tmp_path / f"log_{name}",
                                timeout=120)
        assert result.codes == [0, 0], result.describe()
    ours, theirs = str(tmp_path / "async" / "iter_0000002"), str(tmp_path / "sync" / "iter_0000002")
    names = sorted(os.listdir(ours))
    assert names == sorted(os.listdir(theirs)) and "__1_0.distcp" in names
    assert sorted(os.listdir(os.path.join(ours, "rng"))) == ["rank_00000.pt", "rank_00001.pt"]
    different = [n for n in names if n.endswith(".distcp") or n == "metadata.json"
                 if not filecmp.cmp(os.path.join(ours, n), os.path.join(theirs, n), shallow=False)]
    assert different == []
