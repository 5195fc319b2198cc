"""Continued pretraining as one path (README: Continued pretraining), per family, on tiny random models
transformers builds offline with the family's features on (Llama 3.1: llama3 RoPE scaling with a short
original context; Qwen3: QK-norm; gpt-oss: sinks, alternating windows, YaRN, biased experts with the
clamped GLU), each with its own HF tokenizer: megafab-preprocess tokenizes text with the model's
tokenizer; megafab-convert import-hf writes the checkpoint and its model_flags.toml; pretrain_gpt.py
--config model_flags.toml --load --finetune trains 20 iterations at TP 2 x PP 2 (x EP 2 on 8 ranks for
gpt-oss, ETP 1 as its biased experts need) and the loss falls; megafab-convert export-hf writes a HF
directory that transformers loads, whose logits equal the trained megafab model's, and that generates
with its tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from megafab.cli.convert import main as convert  # noqa: E402
from megafab.cli.preprocess import main as preprocess  # noqa: E402
from megafab.convert import read_checkpoint  # noqa: E402
from megafab.inference.load import model_from_state_dict  # noqa: E402
from tests.helpers.hf_gpt_oss_tiny import hf_gpt_oss  # noqa: E402
from tests.helpers.hf_tiny import LLAMA3_ROPE, hf_dense, megafab_logits  # noqa: E402
from tests.helpers.launch import losses, pretrain_in_ranks  # noqa: E402

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "birds sing in the morning",
             "the sun rises over the hills", "we read a book by the fire", "rain falls on the roof"]
FAMILIES = {"llama3.1": lambda: hf_dense("llama", rope=LLAMA3_ROPE), "qwen3": lambda: hf_dense("qwen3"),
            "gpt-oss": lambda: hf_gpt_oss()}
EXPERTS = {"gpt-oss": ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]}


def _hf_dir_with_tokenizer(model, path):
    """save_pretrained, plus a BPE tokenizer trained on the corpus (ids below the model's vocabulary;
    <s> and </s> at the config's bos/eos ids 1 and 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES * 10, trainers.BpeTrainer(vocab_size=90,
                                                                special_tokens=["<unk>", "<s>", "</s>"]))
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return str(path)


def _corpus(root, hf_dir):
    rng = np.random.default_rng(0)
    with open(root / "text.jsonl", "w", encoding="utf-8") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " . ".join(SENTENCES[i] for i in rng.integers(0, 6, size=4))}) + "\n")
    assert preprocess(["--input", str(root / "text.jsonl"), "--output-prefix", str(root / "corpus"),
                       "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir,
                       "--append-eod", "--workers", "1"]) == 0
    return str(root / "corpus_text_document")


@pytest.mark.slow  # 4 ranks x 20 iterations, an import and an export: ~20 s per family
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_train_at_tp2_pp2_export_and_transformers_generates(family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = _hf_dir_with_tokenizer(FAMILIES[family](), tmp_path / "hf")
    data = _corpus(tmp_path, hf_dir)
    ckpt, run, out = str(tmp_path / "imported"), str(tmp_path / "run"), str(tmp_path / "exported")
    assert convert(["import-hf", "--hf-dir", hf_dir, "--save", ckpt]) == 0
    flags = ["--config", f"{ckpt}/model_flags.toml", "--load", ckpt, "--finetune",
             "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--sequence-parallel",
             "--data-path", data, "--split", "98,1,1", "--seq-length", "32", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "20", "--lr", "3e-3", "--min-lr", "3e-4",
             "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--eval-interval", "1000",
             "--eval-iters", "1", "--log-interval", "1", "--save", run, "--save-interval", "20",
             "--num-workers", "0", *EXPERTS.get(family, [])]
    world = 8 if family in EXPERTS else 4  # EP 2 over TP 2 x DP 2
    text = "".join(pretrain_in_ranks(flags, world_size=world, timeout=600))
    assert f"loaded checkpoint from {ckpt}" in text, text[-3000:]
    lm = losses(text)
    assert sorted(lm) == list(range(1, 21)), text[-3000:]
    first, last = np.mean([lm[i] for i in (1, 2, 3)]), np.mean([lm[i] for i in (18, 19, 20)])
    assert last < first - 0.5, (first, last, lm)
    print(f"{family}: lm loss {first:.3f} (iterations 1-3) -> {last:.3f} (18-20) on {world} ranks")

    assert convert(["export-hf", "--load", run, "--hf-dir", out]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("the dog ran in", return_tensors="pt").input_ids
    sd, cfg = read_checkpoint(run)
    with torch.no_grad():
        ours = megafab_logits(model_from_state_dict(sd, cfg), prompt, cfg.model.vocab_size)
        theirs = hf(prompt).logits
        before = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(prompt).logits
    vocab = hf.config.vocab_size  # the tokenizer's (the run's vocabulary), below the import's 100 here
    assert theirs.shape[-1] == ours.shape[-1] == vocab == len(tokenizer)
    assert (theirs - ours).abs().max() < 1e-5
    # the export holds the trained weights, not the import's
    assert (theirs - before[..., :vocab]).abs().max() > 1e-2
    generated = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, prompt.shape[1] + 8)
    assert tokenizer.decode(generated[0, prompt.shape[1]:]).strip()
