"""Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh, its flags as written
(tests/test_megatron_launch_scripts.py holds them) with only sizes shrunk: 8 experts top-2, EP 2 on
4 CPU ranks, 30 iterations from text that megafab-preprocess tokenized with the script's
Llama2Tokenizer (a tiny SentencePiece model). The loss falls."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megafab.cli.preprocess import main as preprocess
from tests.helpers.launch import losses, pretrain_in_ranks
from tests.helpers.megatron_scripts import MIXTRAL_8X7B, fill, words

# Sizes, run length and layout shrunk; everything else (RMSNorm, SwiGLU, RoPE, GQA, untied
# output, aux loss, grouped GEMM, alltoall, distributed optimizer with overlap, SP, bf16) as the
# script has it. The learning rate is raised so that 30 iterations move the loss.
SHRINK = dict(zip(*[iter(words("""
    --seq-length 32 --max-position-embeddings 64 --num-layers 2 --hidden-size 64 --ffn-hidden-size 128
    --num-attention-heads 4 --num-query-groups 2 --global-batch-size 8 --train-iters 30
    --lr-decay-iters 30 --lr-warmup-iters 3 --lr 3e-3 --min-lr 3e-4 --pipeline-model-parallel-size 1
    --expert-model-parallel-size 2 --split 98,1,1 --eval-interval 1000 --eval-iters 1
    --save-interval 1000"""))] * 2))
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "birds sing in the morning",
             "the sun rises over the hills", "we read a book by the fire", "rain falls on the roof"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    rng = np.random.default_rng(0)
    with open(root / "text.jsonl", "w", encoding="utf-8") as f:
        for _ in range(400):
            text = ". ".join(SENTENCES[i] for i in rng.integers(0, len(SENTENCES), size=4))
            f.write(json.dumps({"text": text}) + "\n")
    spm = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "fixtures", "sp_tiny.model")
    assert preprocess(["--input", str(root / "text.jsonl"), "--output-prefix", str(root / "corpus"),
                       "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", spm, "--append-eod",
                       "--workers", "1"]) == 0
    return {"data": str(root / "corpus_text_document"), "spm": spm, "ckpt": str(root / "ckpt"),
            "tb": str(root / "tb")}


@pytest.mark.slow  # 4 ranks x 30 iterations: 8 s idle, 30 s on a loaded 2-core machine
def test_shrunk_mixtral_trains_and_its_loss_falls(corpus):
    source = fill(MIXTRAL_8X7B, corpus)
    flags = [SHRINK.get(source[i - 1], t) if i and source[i - 1] in SHRINK else t
             for i, t in enumerate(source)]
    assert "--moe-grouped-gemm" in flags and flags[flags.index("--num-experts") + 1] == "8"
    out = "".join(pretrain_in_ranks(flags, world_size=4, timeout=900))
    lm = losses(out)
    assert sorted(lm) == list(range(1, 31)), out[-3000:]
    assert "load_balancing_loss" in out
    first, last = np.mean([lm[i] for i in (1, 2, 3)]), np.mean([lm[i] for i in (28, 29, 30)])
    assert last < first - 0.5, (first, last, lm)
