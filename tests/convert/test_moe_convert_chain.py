"""megafab-convert with a mixture of experts end to end: a tiny random transformers Mixtral (and a
Qwen3-MoE with QK-norm and a dense layer) -> torch_dist recorded at EP 2 -> legacy torch expert-rank
files at EP 2 -> HF -> torch_dist at EP 1; at every step megafab.inference.load_model's logits equal
transformers' within 1e-5, the final HF directory loads in transformers with the same logits, and
megafab's greedy continuation (KV cache on and off) is transformers' greedy generate."""

import os

import pytest
import torch

pytest.importorskip("transformers")

from megafab.cli.convert import main as convert  # noqa: E402
from megafab.inference.generate import SamplingParams, generate  # noqa: E402
from megafab.inference.load import load_model  # noqa: E402
from tests.helpers.hf_moe_tiny import hf_mixtral, hf_qwen3_moe  # noqa: E402

TOKENS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(5))


def _megafab_logits(load_dir):
    model, cfg = load_model(load_dir)
    with torch.no_grad():
        return model(TOKENS).transpose(0, 1)[..., :cfg.model.vocab_size], model


@pytest.mark.parametrize("make", [hf_mixtral, lambda: hf_qwen3_moe(norm_topk_prob=False)],
                         ids=["mixtral", "qwen3-moe"])
def test_hf_to_torch_dist_ep2_to_legacy_ep2_to_hf_to_torch_dist_ep1(make, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = make()
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        expected = hf(TOKENS).logits
    d = {n: str(tmp_path / n) for n in ("dist2", "torch2", "hf2", "dist1")}
    steps = [["--hf-dir", str(tmp_path / "hf"), "--save-dir", d["dist2"], "--saver", "torch_dist",
              "--target-expert-parallel-size", "2", "--make-vocab-size-divisible-by", "8"],
             ["--load-dir", d["dist2"], "--save-dir", d["torch2"], "--saver", "torch",
              "--target-expert-parallel-size", "2"],
             ["--load-dir", d["torch2"], "--save-dir", d["hf2"], "--saver", "hf"],
             ["--hf-dir", d["hf2"], "--save-dir", d["dist1"], "--saver", "torch_dist",
              "--target-expert-parallel-size", "1", "--make-vocab-size-divisible-by", "8"]]
    for step in steps:
        assert convert(["convert", *step]) == 0, step
    files = sorted(os.listdir(os.path.join(d["torch2"], "iter_0000000")))
    assert files == ["mp_rank_00_000", "mp_rank_00_001"]  # one file per EP rank
    for name in ("dist2", "torch2", "dist1"):
        logits, model = _megafab_logits(d[name])
        err = (logits - expected).abs().max().item()
        assert err < 1e-5, (name, err)
    back = AutoModelForCausalLM.from_pretrained(d["hf2"], local_files_only=True).eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - expected).abs().max().item() < 1e-6
    prompt = TOKENS[0, :6].tolist()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 6:].tolist()
    for cache in (True, False):
        assert generate(model, prompt, SamplingParams(max_new_tokens=8), use_kv_cache=cache) == theirs
