"""pretrain_gpt.py with --load of a MoE checkpoint into a dense model, or into a model with another
number of experts (and a dense checkpoint into a MoE model): one message naming what the
checkpoint holds, exit 2, no traceback on any rank."""

from __future__ import annotations

import os
import re

import pytest

from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, assert_one_message

pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="forks its ranks"),
              pytest.mark.slow]  # ~40 s: two saves and three refused loads on a loaded machine
RUN = TINY + ["--mock-data", "--train-iters", "1", "--global-batch-size", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    for name, flags in (("moe", MOE), ("dense", [])):
        flags = RUN + flags + ["--save", str(root / name)]
        result = run_ranks_main(2, flags, root / f"log-{name}", timeout=120)
        assert result.codes == [0, 0], result.describe()
    return root


@pytest.mark.parametrize("ckpt,flags,message", [
    ("moe", [], r"--num-experts: checkpoint 4 \(a mixture-of-experts model\), this run None \(a dense"),
    ("moe", ["--num-experts", "8", "--moe-router-topk", "2"], r"--num-experts: checkpoint 4 .*this run 8"),
    ("dense", MOE, r"--num-experts: checkpoint None \(a dense model\), this run 4"),
], ids=["moe-into-dense", "4-into-8-experts", "dense-into-moe"])
def test_a_checkpoint_of_another_model_kind_is_one_message(saved, tmp_path, ckpt, flags, message):
    flags = RUN + flags + ["--load", str(saved / ckpt), "--finetune"]
    result = run_ranks_main(2, flags, tmp_path, timeout=120)
    text = "".join(result.err + result.out)
    assert "was saved from a different model than this run builds" in text, result.describe()
    assert_one_message(result, r"saved from a different model")
    assert re.search(message, text), text[-2000:]
