"""megafab-convert between Megatron torch_dist (written by megatron-core 0.16.1), Megatron
legacy torch, HF and back, changing TP/PP at each step: every checkpoint it writes gives
megatron-core's logits in megafab (fp32, 1e-5), the torch_dist one in megatron-core too, the HF one
in transformers; each phase shows a progress bar; what is not a checkpoint is refused by name."""

import os

import pytest
import torch

from megafab.checkpoint import checkpointing
from megafab.cli.convert import main as convert
from megafab.run.fork_ranks import run_ranks
from tests.helpers import mcore
from tests.helpers.checkpoint import full_logits, make_state
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, tiny_config

STYLES = {"gpt2": GPT2_STYLE, "llama": {**LLAMA_STYLE, "rotary_percent": 1.0}}  # HF Llama: full rotary
TOKENS = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(5))
VOCAB = 101


def _mcore_save(rank, world, style, root):
    mcore.init_parallel(tp=world)
    m = tiny_config(tp=world, style=STYLES[style]).model
    model = mcore.gpt_model(m)
    mcore.save(model, root, common={"args": mcore.megatron_args(m, world, 1), "iteration": 10,
                                    "checkpoint_version": 3.0})
    return mcore.logits(model, TOKENS)


def _megafab_logits(rank, world, style, root):
    state = make_state(tp=1, dp=1, dist_opt=False, style=STYLES[style], dtype=torch.float32, load=root,
                       finetune=True)
    checkpointing.load_checkpoint(state)
    return full_logits(state, TOKENS)


def _mcore_logits(rank, world, style, path, padded_for_tp):
    mcore.init_parallel(tp=world)
    model = mcore.gpt_model(tiny_config(tp=padded_for_tp, style=STYLES[style]).model, seed=11)
    mcore.load(model, path)
    return mcore.logits(model, TOKENS)


def _close(got, expected, atol=1e-5):
    return (got[..., :VOCAB] - expected[..., :VOCAB]).abs().max().item() < atol


@pytest.mark.parametrize("style", sorted(STYLES))
def test_conversions_in_every_direction_keep_megatron_cores_logits(tmp_path, style, capsys):
    from transformers import AutoModelForCausalLM

    d = {name: str(tmp_path / name) for name in ("mcore", "torch", "dist", "hf", "from_hf")}
    expected = run_ranks(_mcore_save, 2, style, d["mcore"], timeout=240)[0]
    steps = [["--load-dir", d["mcore"], "--save-dir", d["torch"], "--saver", "torch",
              "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"],
             ["--load-dir", d["torch"], "--save-dir", d["dist"], "--saver", "torch_dist",
              "--target-tensor-parallel-size", "2"],
             ["--load-dir", d["dist"], "--save-dir", d["hf"], "--saver", "hf"],
             ["--hf-dir", d["hf"], "--save-dir", d["from_hf"], "--saver", "torch",
              "--target-tensor-parallel-size", "2", "--make-vocab-size-divisible-by", "8"]]
    for step in steps:
        assert convert(["convert", *step]) == 0, step
    err = capsys.readouterr().err
    assert "reading torch_dist" in err and "reading torch" in err and "writing torch" in err
    files = {name: sorted(os.listdir(os.path.join(d[name], "iter_0000000"))) for name in ("torch", "from_hf")}
    assert files == {"torch": ["mp_rank_00_000", "mp_rank_00_001"], "from_hf": ["mp_rank_00", "mp_rank_01"]}

    for name in ("torch", "dist", "from_hf"):
        assert _close(run_ranks(_megafab_logits, 1, style, d[name], timeout=240)[0], expected), name
    # megatron-core reads the torch_dist written for TP 2 (the TP 1 legacy files' vocabulary of 104
    # rows padded again to 112) at TP 2
    got = run_ranks(_mcore_logits, 2, style, os.path.join(d["dist"], "iter_0000000"), 2, timeout=240)[0]
    assert _close(got, expected)
    hf = AutoModelForCausalLM.from_pretrained(d["hf"], local_files_only=True).eval()
    with torch.no_grad():
        assert _close(hf(TOKENS).logits, expected, atol=1e-4)


def test_foreign_and_empty_directories_are_refused_naming_what_was_found(tmp_path, capsys):
    (tmp_path / "empty" / "iter_0000001").mkdir(parents=True)
    (tmp_path / "empty" / "latest_checkpointed_iteration.txt").write_text("1")
    (tmp_path / "foreign" / "iter_0000001").mkdir(parents=True)
    (tmp_path / "foreign" / "iter_0000001" / "weights.npz").write_bytes(b"")
    (tmp_path / "foreign" / "latest_checkpointed_iteration.txt").write_text("1")
    for name, found in (("empty", "holds nothing"), ("foreign", "holds weights.npz")):
        assert convert(["convert", "--load-dir", str(tmp_path / name), "--save-dir", str(tmp_path / "o"),
                        "--saver", "hf"]) == 2
        err = capsys.readouterr().err
        assert found in err and "metadata.json" in err and "mp_rank_XX" in err, err
