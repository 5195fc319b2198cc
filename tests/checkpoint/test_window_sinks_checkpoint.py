"""A GPT with sliding-window layers and learnable attention sinks in Megatron's checkpoint formats:
the sink is stored as megatron-core's `decoder.layers.<N>.self_attention.core_attention.softmax_offset`
[heads], split over TP by heads. torch_dist: megafab's save at TP 2 loads into megafab at TP 1 and
into megatron-core 0.16.1 (local spec, window and sinks on) at TP 1 and TP 2 with megafab's logits.
Legacy torch files: megatron-core's own at TP 2 (its per-rank [heads/2] sinks) load into megafab at
TP 1 with its logits."""

import os

import torch
import torch.distributed as dist

from megafab.checkpoint import checkpointing
from megafab.run.fork_ranks import run_ranks
from tests.helpers import mcore
from tests.helpers.checkpoint import full_logits, make_state, perturb, read_everything
from tests.helpers.tiny import LLAMA_STYLE, tiny_config

STYLE = dict(LLAMA_STYLE, rotary_percent=1.0, window_size=(3, 0), window_attn_skip_freq=2,
             softmax_type="learnable")
TOKENS = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))


def _megafab_save(rank, world, root):
    state = make_state(tp=world, dp=1, dist_opt=False, style=STYLE, dtype=torch.float32, save=root)
    perturb(state)
    checkpointing.save_checkpoint(state)
    return full_logits(state, TOKENS)


def _megafab_load(rank, world, root):
    state = make_state(tp=world, dp=1, dist_opt=False, style=STYLE, dtype=torch.float32, load=root,
                       finetune=True)
    assert checkpointing.load_checkpoint(state) == 0
    return full_logits(state, TOKENS)


def _mcore_load(rank, world, path):
    mcore.init_parallel(tp=world)
    m = tiny_config(tp=2, style=STYLE).model  # the padded vocabulary megafab saved at TP 2
    model = mcore.gpt_model(m, seed=99)
    before = mcore.logits(model, TOKENS)
    mcore.load(model, path)
    return before, mcore.logits(model, TOKENS)


def test_sinks_save_at_tp2_and_load_at_tp1_and_into_megatron_core(tmp_path):
    root = str(tmp_path / "megafab")
    expected = run_ranks(_megafab_save, 2, root, timeout=240)[0]
    path = str(tmp_path / "megafab" / "iter_0000000")
    stored = read_everything(path)
    sink = stored["model.decoder.layers.1.self_attention.core_attention.softmax_offset"]
    assert sink.shape == (tiny_config(style=STYLE).model.num_attention_heads,)
    vocab = tiny_config(style=STYLE).model.vocab_size  # padded otherwise at TP 1 and 2
    at_tp1 = run_ranks(_megafab_load, 1, root, timeout=240)[0]
    assert (at_tp1[..., :vocab] - expected[..., :vocab]).abs().max().item() < 1e-5
    for tp in (1, 2):
        before, got = run_ranks(_mcore_load, tp, path, timeout=240)[0]
        assert (before - expected).abs().max().item() > 1e-2  # the load changed something
        err = (got - expected).abs().max().item()
        assert err < 1e-5, (f"megatron-core at TP {tp}", err)


def _mcore_legacy_save(rank, world, root):
    mcore.init_parallel(tp=world)
    m = tiny_config(tp=world, style=STYLE).model
    model = mcore.gpt_model(m)
    state = {"args": mcore.megatron_args(m, world, 1, ckpt_format="torch", window_size=m.window_size,
                                         window_attn_skip_freq=m.window_attn_skip_freq,
                                         softmax_type=m.softmax_type),
             "checkpoint_version": 3.0, "iteration": 10, "model": model.state_dict_for_save_checkpoint()}
    directory = os.path.join(root, "iter_0000010", f"mp_rank_{rank:02d}")
    os.makedirs(directory, exist_ok=True)
    torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("10")
    dist.barrier()
    sink = "decoder.layers.0.self_attention.core_attention.softmax_offset"
    assert model.state_dict()[sink].shape == (m.num_attention_heads // world,)
    return mcore.logits(model, TOKENS)


def _megafab_legacy_load(rank, world, root):
    state = make_state(tp=1, dp=1, dist_opt=False, style=STYLE, dtype=torch.float32, load=root,
                       ckpt_format="torch", finetune=True, no_load_optim=True, no_load_rng=True)
    assert checkpointing.load_checkpoint(state) == 10
    return full_logits(state, TOKENS)


def test_megatron_core_legacy_files_with_sinks_load_into_megafab_at_tp1(tmp_path):
    root = str(tmp_path / "legacy")
    expected = run_ranks(_mcore_legacy_save, 2, root, timeout=240)[0]
    got = run_ranks(_megafab_legacy_load, 1, root, timeout=240)[0]
    vocab = tiny_config(style=STYLE).model.vocab_size
    assert (got[..., :vocab] - expected[..., :vocab]).abs().max().item() < 1e-5
