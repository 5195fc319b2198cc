"""Megatron-LM HEAD's examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh, its PRETRAIN_ARGS as written
(TP 1, EP 8, MBS 4, GBS 2048: the script's defaults; its Megatron-FSDP, profiling and WANDB blocks
are not model flags and stay off) with sizes shrunk: 8 experts top-2 in 4 groups, EP 2 on 4 CPU
ranks, one MTP layer, 30 iterations from text that megafab-preprocess tokenized with the script's
HuggingFaceTokenizer (a tiny tokenizer.json). Multi-latent attention with YaRN, sigmoid group routing
with expert bias and forced balancing, seq_aux_loss, selective recompute of mlp moe mla_up_proj
layernorm, the distributed optimizer with overlap, bf16 as the script has them. The loss falls."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from megafab.cli.preprocess import main as preprocess
from tests.helpers.launch import losses, pretrain_in_ranks
from tests.helpers.megatron_scripts import fill, words

DEEPSEEK_V3 = words("""
    --distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 8
    --expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer
    --overlap-grad-reduce --overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn
    --disable-bias-linear --micro-batch-size 4 --global-batch-size 2048 --train-samples 585937500
    --exit-duration-in-mins 220 --no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10
    --recompute-granularity selective --recompute-modules mlp moe mla_up_proj layernorm
    --transformer-impl transformer_engine --seq-length 4096 --data-cache-path {cache}
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model deepseek-ai/DeepSeek-V3 --data-path {data}
    --split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 6
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128
    --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 10000
    --make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --untie-embeddings-and-output-weights --multi-latent-attention --attention-dropout 0.0
    --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm --lr-decay-samples 584765624
    --lr-warmup-samples 1536000 --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine
    --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 256 --moe-layer-freq [0]*3+[1]*58
    --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048
    --moe-router-load-balancing-type seq_aux_loss --moe-router-topk 8 --moe-token-dispatcher-type flex
    --moe-flex-dispatcher-backend hybridep --moe-router-pre-softmax --moe-grouped-gemm
    --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 4 --moe-router-num-groups 8
    --moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
    --moe-router-force-load-balancing --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
    --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --eval-iters 32 --eval-interval 100
    --auto-detect-ckpt-format --load {ckpt} --save {ckpt} --save-interval 100 --dist-ckpt-strictness log_all
    --init-method-std 0.02 --log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad
    --log-params-norm --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1
    --logging-level 40 --tensorboard-dir {tb} --bf16 --enable-experimental""")
# Sizes, run length (240 samples of 8 a step: 30 iterations), layout and loader workers shrunk;
# the learning rate raised so that 30 iterations move the loss.
SHRINK = dict(zip(*[iter(words("""
    --expert-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --train-samples 240
    --seq-length 32 --num-workers 0 --num-layers 2 --hidden-size 64 --ffn-hidden-size 128
    --num-attention-heads 4 --kv-channels 16 --max-position-embeddings 32 --lr-decay-samples 240
    --lr-warmup-samples 24 --lr 3e-3 --min-lr 3e-4 --num-experts 8 --moe-layer-freq [0]*1+[1]*1
    --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 --moe-router-topk 2
    --moe-router-group-topk 2 --moe-router-num-groups 4 --q-lora-rank 24 --kv-lora-rank 16
    --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --eval-iters 1
    --distributed-timeout-minutes 2"""))] * 2))
# What this CPU refuses by name, swapped for megafab's equivalents: Transformer Engine (not
# installed) -> the local implementation; the flex dispatcher with HybridEP and the TE permute fusion
# (GPU-only kernels) -> the alltoall dispatcher, unfused. The tokenizer: a tiny local tokenizer.json.
SWAP = {"--transformer-impl": "local", "--moe-token-dispatcher-type": "alltoall", "--tokenizer-model": "{hf}"}
DROP = {"--moe-flex-dispatcher-backend": 1, "--moe-permute-fusion": 0}
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "birds sing in the morning",
             "the sun rises over the hills", "we read a book by the fire", "rain falls on the roof"]
MTP_LOSS = re.compile(r"iteration\s+(\d+)/.*? mtp_1 loss: (\S+) \|")
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "fixtures")


def shrunk(paths: dict) -> list[str]:
    """The script's flags with SHRINK's and SWAP's values and without DROP's, paths filled in."""
    out, skip = [], 0
    for i, token in enumerate(DEEPSEEK_V3):
        previous = DEEPSEEK_V3[i - 1] if i else ""
        if skip:
            skip -= 1
        elif token in DROP:
            skip = DROP[token]
        elif previous in SHRINK or previous in SWAP:
            out.append(SHRINK.get(previous) or SWAP[previous])
        else:
            out.append(token)
    return fill(out, paths)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    rng = np.random.default_rng(0)
    with open(root / "text.jsonl", "w", encoding="utf-8") as f:
        for _ in range(400):
            text = ". ".join(SENTENCES[i] for i in rng.integers(0, len(SENTENCES), size=4))
            f.write(json.dumps({"text": text}) + "\n")
    hf = os.path.join(FIXTURES, "hf_tiny")
    assert preprocess(["--input", str(root / "text.jsonl"), "--output-prefix", str(root / "corpus"),
                       "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf, "--append-eod",
                       "--workers", "1"]) == 0
    return {"data": str(root / "corpus_text_document"), "hf": hf, "ckpt": str(root / "ckpt"),
            "tb": str(root / "tb"), "cache": str(root / "cache")}


def test_shrinking_keeps_the_script_flags(corpus):
    flags = shrunk(corpus)
    script = [t for t in DEEPSEEK_V3 if t.startswith("--")]
    assert [t for t in flags if t.startswith("--")] == [t for t in script if t not in DROP]
    for flag in ("--multi-latent-attention", "--moe-router-force-load-balancing", "--enable-experimental",
                 "--bf16", "--qk-layernorm", "--use-distributed-optimizer"):
        assert flag in flags
    assert flags[flags.index("--mtp-num-layers") + 1] == "1"
    assert flags[flags.index("--rotary-scaling-factor") + 1] == "40"
    assert flags[flags.index("--recompute-modules") + 1: flags.index("--recompute-modules") + 5] == \
        ["mlp", "moe", "mla_up_proj", "layernorm"]


@pytest.mark.slow  # 4 ranks x 30 iterations: 30 s on a loaded 2-core machine
def test_shrunk_deepseek_v3_trains_and_its_loss_falls(corpus):
    out = "".join(pretrain_in_ranks(shrunk(corpus), world_size=4, timeout=900))
    lm = losses(out)
    assert sorted(lm) == list(range(1, 31)), out[-3000:]
    mtp = {int(m.group(1)): float(m.group(2)) for m in MTP_LOSS.finditer(out)}
    assert sorted(mtp) == sorted(lm) and "seq_load_balancing_loss" in out, out[-3000:]
    for losses_of in (lm, mtp):  # the main loss and the MTP depth's (8.1 -> 3.7 and 3.8 here)
        first = np.mean([losses_of[i] for i in (1, 2, 3)])
        last = np.mean([losses_of[i] for i in (28, 29, 30)])
        assert last < first - 0.5, (first, last, losses_of)
