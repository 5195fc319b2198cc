"""A GPT with sliding-window layers and learnable attention sinks in Megatron's torch_dist format:
the sink is stored as megatron-core's `decoder.layers.<N>.self_attention.core_attention.softmax_offset`
[heads], split over TP by heads; megafab's save at TP 2 loads into megafab at TP 1 and into
megatron-core 0.16.1 (local spec, window and sinks on) at TP 1 and TP 2 with megafab's logits."""

import torch

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
