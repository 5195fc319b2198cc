"""megafab's torch_dist saves of DeepSeek-V3's shape in small (multi-latent attention with a query LoRA
and YaRN, a dense first layer then MoE layers with a shared expert and sigmoid group routing with the
expert bias, one MTP layer; tests/helpers/mcore_deepseek.py) reshard on load, float64, the Adam state
included: TP 2 (+SP) -> TP 1, EP 2 -> EP 4 (distributed optimizer), PP 2 (MTP on the last stage) ->
PP 1. The run saved at iteration 2 goes on to iteration 4; the resumed run re-saves what it loaded
(every stored tensor equal to the saved ones: weights, expert biases, Adam's moments) and trains 2
steps logging the uninterrupted run's losses within 1e-10, its weights within 1e-10."""

from __future__ import annotations

import pytest
import torch

from megafab.checkpoint import checkpointing, directory
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import read_everything, train
from tests.helpers.mcore_deepseek import deepseek_state


def _straight(rank, world, path, layout):
    state = deepseek_state(save=path, **layout)
    losses = train(state, 2)
    checkpointing.save_checkpoint(state)
    losses += train(state, 2)
    checkpointing.save_checkpoint(state)
    return losses


def _resumed(rank, world, src, dst, layout):
    state = deepseek_state(load=src, save=dst, ckpt_step=2, **layout)
    assert checkpointing.load_checkpoint(state) == 2
    checkpointing.save_checkpoint(state)  # what it loaded, saved again at its own layout
    losses = train(state, 2)
    checkpointing.save_checkpoint(state)
    return losses


def _compare(a: dict, b: dict, exact: bool):
    assert a.keys() == b.keys() and any(k.endswith(".exp_avg_sq") for k in a)
    assert any(k.startswith("optim.mtp.layers.0.") for k in a)
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            assert torch.allclose(a[k], b[k], rtol=0, atol=1e-10), (k, (a[k] - b[k]).abs().max().item())


@pytest.mark.parametrize("saved, resumed", [
    ((2, {"tp": 2}), (1, {})),
    ((2, {"ep": 2, "dp": 2, "dist_opt": True}), (4, {"ep": 4, "dp": 4, "dist_opt": True})),
    ((2, {"pp": 2}), (1, {})),
], ids=["tp2_to_tp1", "ep2_to_ep4", "pp2_to_pp1"])
def test_deepseek_checkpoint_reshards_and_resumes_exactly(tmp_path, saved, resumed):
    a, b = str(tmp_path / "saved"), str(tmp_path / "resumed")
    expected = run_ranks(_straight, saved[0], a, saved[1], timeout=240)[-1]  # the last stage's losses
    got = run_ranks(_resumed, resumed[0], a, b, resumed[1], timeout=240)[-1]
    assert len(got) == 2
    for x, y in zip(got, expected[2:]):
        assert abs(x - y) <= 1e-10 * abs(y), (got, expected)
    _compare(read_everything(directory.iteration_dir(a, 2)), read_everything(directory.iteration_dir(b, 2)),
             exact=True)
    _compare(read_everything(directory.iteration_dir(a, 4)), read_everything(directory.iteration_dir(b, 4)),
             exact=False)
    print(f"MEASURED {saved[1]} -> {resumed[1]}: losses {got} uninterrupted {expected[2:]}")
