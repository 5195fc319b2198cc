"""The catalogue of bad inputs (issue 18): each ends with one `megafab: error:` line naming the
problem, exit 2, no traceback on any rank, no hang. Ranks are forked from the test process
(tests/helpers/main_ranks.py), so the imports are paid once for the whole catalogue.

Checkpoint files: tests/training/test_checkpoint_catalogue.py; dead, frozen and restarted ranks:
tests/training/test_faults.py. Preprocess inputs are tests/data's (tools/preprocess_data.py).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from tests.helpers.launch import losses
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, assert_one_message, error_lines, write_corpus

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the catalogue forks its ranks")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return {"good": write_corpus(str(root / "good")),
            "few": write_corpus(str(root / "few"), num_docs=30),
            "empty": write_corpus(str(root / "empty"), num_docs=0),
            "big_ids": write_corpus(str(root / "big_ids"), max_id=127, bad_token=(5, 200)),
            "late_bad_id": write_corpus(str(root / "late_bad_id"), bad_token=(7, 500)),
            "root": root}


def _damaged(corpus, tmp_path, damage) -> str:
    prefix = str(tmp_path / "damaged")
    for ext in (".bin", ".idx"):
        shutil.copy(corpus["good"] + ext, prefix + ext)
    damage(prefix)
    return prefix


def _truncate(path, keep):
    with open(path, "r+b") as f:
        f.truncate(keep)


def _overwrite(path, data: bytes):
    with open(path, "r+b") as f:
        f.write(data)


DAMAGE = {
    "truncated .idx": (lambda p: _truncate(p + ".idx", 100), r"damaged\.idx: truncated index"),
    "wrong .idx": (lambda p: _overwrite(p + ".idx", b"NOTMMIDX!"), r"damaged\.idx: wrong magic"),
    "short .bin": (lambda p: _truncate(p + ".bin", 1000), r"damaged\.bin: data file is 1000 bytes"),
    "missing .bin": (lambda p: os.remove(p + ".bin"), r"damaged\.bin: file not found"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_dataset_files(corpus, tmp_path, case):
    damage, message = DAMAGE[case]
    prefix = _damaged(corpus, tmp_path, damage)
    result = run_ranks_main(1, TINY + ["--train-iters", "2", "--data-path", prefix, "--split", "90,5,5"],
                            tmp_path, timeout=90)
    assert_one_message(result, message)


# (what the user gave, the flags, the message the job must end with)
BAD_DATA_FLAGS = [
    ("empty dataset pair", ["--data-path", "empty", "--split", "90,5,5"],
     r"empty: the dataset holds no documents"),
    ("negative blend weight", ["--data-path", "-1", "good", "2", "good"],
     r"blend weight -1 must be a positive"),
    ("blend weight that is no number", ["--data-path", "0.3", "good", "0.7x", "good"],
     r"'0\.7x' stands where a weight belongs"),
    ("split of words", ["--data-path", "good", "--split", "a,b"], r"--split 'a,b': expected up to three"),
    ("few documents, default split", ["--data-path", "few"],
     r"few: --split 969,30,1 gives the test split documents .* i\.e\. none"),
    ("ids beyond the vocabulary", ["--data-path", "big_ids", "--split", "90,5,5"],
     r"big_ids\.bin holds token id 200, outside the tokenizer's vocabulary 0\.\.127"),
    ("ids inside the padding", ["--data-path", "good", "--split", "90,5,5", "--vocab-size", "110"],
     r"good\.bin holds token id 127, outside the tokenizer's vocabulary 0\.\.110"),
    ("prefix that does not exist", ["--data-path", "nowhere"], r"nowhere\.idx not found"),
    ("nan-check limit below zero", ["--mock-data", "--max-consecutive-skipped-iterations", "-1"],
     r"--max-consecutive-skipped-iterations -1 must be at least 0"),
]


@pytest.mark.parametrize("flags,message", [c[1:] for c in BAD_DATA_FLAGS], ids=[c[0] for c in BAD_DATA_FLAGS])
def test_bad_data_flags(corpus, tmp_path, flags, message):
    flags = [os.path.join(corpus["root"], f) if f in corpus and f != "root" else f for f in flags]
    result = run_ranks_main(1, TINY + ["--train-iters", "2", *flags], tmp_path, timeout=90)
    assert_one_message(result, message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL is usable where CUDA is")
def test_nccl_without_cuda_two_ranks(corpus, tmp_path):
    flags = ["--train-iters", "2", "--data-path", corpus["good"], "--distributed-backend", "nccl"]
    result = run_ranks_main(2, TINY + flags, tmp_path, timeout=90)
    assert_one_message(result, r"--distributed-backend nccl needs CUDA GPUs")


def _no_upfront_scan(rank):
    import megafab.data.token_range as token_range

    token_range.SCAN_LIMIT_BYTES = 0  # as for a dataset too large to scan without --data-cache-path


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_id_read_by_one_rank_ends_the_job_with_its_message(corpus, tmp_path, workers):
    """DP 2: the rank that reads the bad sample speaks, the other one (waiting in a collective)
    stops silently and at once; from a DataLoader worker the message comes back as raised."""
    flags = TINY + ["--train-iters", "200", "--data-path", corpus["late_bad_id"], "--split", "90,5,5",
                    "--global-batch-size", "2", "--num-workers", str(workers)]
    result = run_ranks_main(2, flags, tmp_path, timeout=90, before_main=_no_upfront_scan)
    line = assert_one_message(result, r"late_bad_id: train sample \d+ holds token id 500")
    speaker = [r for r, e in enumerate(result.err) if line in e]
    assert len(speaker) == 1
    assert max(result.elapsed) - min(result.elapsed) < 10, result.elapsed  # the other rank did not wait


def _nan_run(corpus, tmp_path, extra, nproc=1):
    ckpt = str(tmp_path / "ckpt")
    flags = TINY + ["--train-iters", "6", "--data-path", corpus["good"], "--split", "90,5,5", "--lr", "1e6",
                    "--save", ckpt, "--save-interval", "1", *extra]
    return run_ranks_main(nproc, flags, tmp_path, timeout=120), ckpt


def test_nan_stops_at_the_first_non_finite_iteration(corpus, tmp_path):
    skipping, _ = _nan_run(corpus, tmp_path / "skip", ["--no-check-for-nan-in-loss-and-grad"])
    assert skipping.codes == [0], skipping.describe()
    nan_counts = [int(m) for m in re.findall(r"number of nan iterations:\s+(\d+)", skipping.out[0])]
    first_bad = next(i for i, n in enumerate(nan_counts, start=1) if n > 0)

    checked, ckpt = _nan_run(corpus, tmp_path / "check", [])
    line = assert_one_message(checked, rf"iteration {first_bad}: the (loss|gradient norm) is .* on rank\(s\) "
                                       rf"\[0\]")
    assert f"the last good checkpoint is {ckpt}/iter_{first_bad - 1:07d}" in line
    assert sorted(losses(checked.out[0])) == list(range(1, first_bad))  # nothing logged past it


def test_nan_on_the_last_pipeline_stage_names_that_rank(corpus, tmp_path):
    result, _ = _nan_run(corpus, tmp_path, ["--pipeline-model-parallel-size", "2"], nproc=2)
    assert_one_message(result, r"iteration \d+: the (loss|gradient norm) is .* on rank\(s\) \[")
    assert "no optimizer step" not in error_lines(result)[0]


def test_too_many_skipped_iterations_in_a_row_stop_the_run(corpus, tmp_path):
    result, _ = _nan_run(corpus, tmp_path, ["--no-check-for-nan-in-loss-and-grad",
                                    "--max-consecutive-skipped-iterations", "2"])
    assert_one_message(result, r"iterations \d+\.\.\d+: 2 optimizer steps in a row were skipped")


def test_fp16_loss_scale_overflows_are_skipped_as_before(corpus, tmp_path):
    flags = TINY + ["--train-iters", "3", "--data-path", corpus["good"], "--split", "90,5,5", "--fp16",
                    "--initial-loss-scale", str(2.0**40)]
    result = run_ranks_main(1, flags, tmp_path, timeout=120)
    assert result.codes == [0], result.describe()
    assert re.search(r"number of skipped iterations:\s+[1-9]", result.out[0]), result.out[0][-2000:]
