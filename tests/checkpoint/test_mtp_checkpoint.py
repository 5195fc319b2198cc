"""A GPT with multi-token prediction trained at PP 2 (MTP and its copy of the word embedding on the
last stage), saved (torch_dist, and Megatron's legacy per-rank files) and resumed at PP 1 continues
exactly (float64, Adam's state included; the legacy files' weights only): the
mtp.layers.* tensors are written once (the embedding copy by the first stage only) and read back
where the new layout holds them."""

import pytest
import torch

from megafab.checkpoint import checkpointing
from megafab.checkpoint.state import named_parameters
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import make_state, train
from tests.helpers.tiny import LLAMA_STYLE

TIED = dict(LLAMA_STYLE, untie_embeddings_and_output_weights=False)


def _run(rank, world, root, save: bool, ckpt_format: str):
    legacy = {"no_save_optim": True, "no_load_optim": True} if ckpt_format == "torch" else {}
    state = make_state(tp=1, dp=1, pp=world, dist_opt=False, style=TIED, mtp_num_layers=2,
                       save=root if save else None, load=None if save else root, ckpt_format=ckpt_format,
                       **legacy)
    if save:
        train(state, 2)
        checkpointing.save_checkpoint(state)
    else:
        assert checkpointing.load_checkpoint(state) == 2
    weights = {name: p.detach().clone() for name, p in named_parameters(state)}
    return weights, train(state, 2)


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_mtp_checkpoint_saved_at_pp2_resumes_at_pp1(tmp_path, ckpt_format):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(_run, 2, root, True, ckpt_format, timeout=240)
    (loaded, resumed), = run_ranks(_run, 1, root, False, ckpt_format, timeout=240)
    first, last = saved[0][0], saved[1][0]
    assert any(n.startswith("mtp.layers.1.") for n in last) and not any(n.startswith("mtp.") for n in first)
    assert torch.equal(first["embedding.word_embeddings.weight"], last["embedding.word_embeddings.weight"])
    assert loaded.keys() == first.keys() | last.keys()
    for name, value in {**first, **last}.items():
        assert torch.equal(loaded[name], value), name
    if ckpt_format == "torch_dist":  # the legacy files keep no optimizer state (Megatron's order)
        continued = saved[1][1]  # the last stage's rank logs the loss
        assert all(abs(a - b) < 1e-10 for a, b in zip(resumed, continued)), (resumed, continued)
