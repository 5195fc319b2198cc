"""Megatron-LM torch_dist checkpoints in both directions, megatron-core 0.16.1 as the oracle (fp32):
its dist_checkpointing.save at TP 1 and TP 2 loads into megafab at TP 1, TP 2 and PP 2 with its
logits; megafab's --ckpt-format torch_dist save at TP 2 x PP 2 loads into megatron-core with
megafab's logits; training continues from a Megatron checkpoint with --finetune."""

import pytest
import torch

from megafab.checkpoint import checkpointing
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import train_step
from tests.helpers import mcore
from tests.helpers.checkpoint import full_logits, make_state, perturb
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, tiny_config

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


def _megafab_save(rank, world, style, root):
    state = make_state(tp=2, pp=2, dp=1, dist_opt=False, style=STYLES[style], dtype=torch.float32, save=root)
    perturb(state)
    checkpointing.save_checkpoint(state)
    return full_logits(state, TOKENS)


def _mcore_load(rank, world, style, path):
    mcore.init_parallel(tp=world)
    m = tiny_config(tp=2, style=STYLES[style]).model  # the padded vocabulary megafab saved at TP 2
    model = mcore.gpt_model(m, seed=99)
    before = mcore.logits(model, TOKENS)
    mcore.load(model, path)
    return before, mcore.logits(model, TOKENS)


@pytest.mark.parametrize("style", sorted(STYLES))
def test_megafab_torch_dist_at_tp2_pp2_loads_into_megatron_core(tmp_path, style):
    root = str(tmp_path / "megafab")
    expected = run_ranks(_megafab_save, 4, style, root, timeout=240)[-1]
    path = str(tmp_path / "megafab" / "iter_0000000")
    for tp in (1, 2):
        before, got = run_ranks(_mcore_load, tp, style, path, timeout=240)[0]
        assert (before - expected).abs().max().item() > 1e-2  # the load changed something
        err = (got - expected).abs().max().item()
        assert err < 1e-5, (style, f"megatron-core at TP {tp}", err)


def _mcore_save_with_loss(rank, world, root):
    """megatron-core's mean loss of sample 0 of TOKENS (inputs [:-1], labels [1:])."""
    mcore.init_parallel(tp=world)
    model = mcore.gpt_model(tiny_config(tp=world, style=LLAMA_STYLE).model)
    common = {"args": mcore.megatron_args(tiny_config(tp=world, style=LLAMA_STYLE).model, world, 1),
              "iteration": 10, "checkpoint_version": 3.0}
    mcore.save(model, root, common=common)
    logits = mcore.logits(model, TOKENS[:1, :-1])
    return torch.nn.functional.cross_entropy(logits[0], TOKENS[0, 1:]).item()


def _finetune(rank, world, root):
    state = make_state(tp=2, dp=1, dist_opt=True, style=LLAMA_STYLE, dtype=torch.float32, load=root,
                       finetune=True, lr=1e-2)
    assert checkpointing.load_checkpoint(state) == 10 and state.iteration == 0
    tokens, labels = TOKENS[:1, :-1].contiguous(), TOKENS[:1, 1:].contiguous()
    micro = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(tokens, dtype=torch.float32)}
    return [train_step(state, iter([micro] * state.cfg.training.num_micro_batches))["lm loss"]
            for _ in range(6)]


def test_training_continues_from_a_megatron_checkpoint_with_finetune(tmp_path):
    root = str(tmp_path / "mcore")
    mcore_loss = run_ranks(_mcore_save_with_loss, 2, root, timeout=240)[0]
    losses = run_ranks(_finetune, 2, root, timeout=240)[0]
    # the first step's loss is megatron-core's on its weights (the loaded model, not a fresh one)
    assert abs(losses[0] - mcore_loss) < 1e-4, (losses[0], mcore_loss)
    assert losses[-1] < losses[0] - 0.5, losses
