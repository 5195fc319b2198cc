"""--dist-ckpt-strictness as megatron-core's StrictHandling: a torch_dist checkpoint lacking a tensor
the model needs ("unexpected") or holding one it does not load ("missing") is refused, logged or
ignored by the value, the unexpected parameter keeping its initial value when the load goes on."""

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.checkpoint import CheckpointError, checkpointing
from megafab.checkpoint.strictness import apply, mismatches
from megafab.config import ConfigError
from megafab.convert import write_checkpoint
from megafab.model.gpt import GPTModel
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import make_state
from tests.helpers.flags import tiny_flags
from tests.helpers.tiny import context, tiny_config

DROPPED = "decoder.final_layernorm.weight"  # the model's, not in the checkpoint
EXTRA = "decoder.final_extra.weight"  # the checkpoint's, not the model's


def _checkpoint(root, drop=False, extra=False):
    cfg = tiny_config()
    model = GPTModel(cfg.model, context(dtype=torch.float64))
    sd = {k: v.detach() * 2 for k, v in model.state_dict().items()}
    if drop:
        del sd[DROPPED]
    if extra:
        sd[EXTRA] = torch.ones(3, dtype=torch.float64)
    write_checkpoint(root, sd, cfg, iteration=1)


def _load(rank, world, root, strictness):
    state = make_state(tp=1, dp=1, dist_opt=False, load=root, finetune=True, dist_ckpt_strictness=strictness)
    module = state.model[0].module
    before = module.get_parameter(DROPPED).detach().clone()
    try:
        checkpointing.load_checkpoint(state)
    except CheckpointError as e:
        return "error", str(e)
    bias = module.get_parameter(DROPPED).detach()
    embedding = module.embedding.word_embeddings.weight.detach()
    return "loaded", (torch.equal(bias, before), float(embedding.abs().sum()))


@pytest.mark.parametrize("strictness,outcome,printed", [
    ("assume_ok_unexpected", "error", None), ("raise_unexpected", "error", None),
    ("raise_all", "error", None),
    ("log_unexpected", "loaded", "warning: "), ("log_all", "loaded", "warning: "),
    ("return_unexpected", "loaded", None), ("return_all", "loaded", None), ("ignore_all", "loaded", None)])
def test_a_tensor_the_checkpoint_lacks(tmp_path, capfd, strictness, outcome, printed):
    root = str(tmp_path / "ck")
    _checkpoint(root, drop=True)
    [(kind, value)] = run_ranks(_load, 1, root, strictness, timeout=120)
    out = capfd.readouterr().out
    assert kind == outcome, value
    if outcome == "error":
        assert DROPPED in value
        if strictness != "assume_ok_unexpected":
            assert f"--dist-ckpt-strictness {strictness}" in value and "(unexpected)" in value
        return
    kept_initial, embedding_sum = value
    assert kept_initial and embedding_sum > 0  # the rest loaded
    warned = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert bool(warned) == (printed is not None), out
    if warned:
        assert DROPPED in warned[0] and "(unexpected)" in warned[0]


@pytest.mark.parametrize("strictness,outcome", [
    ("assume_ok_unexpected", "quiet"), ("log_unexpected", "quiet"), ("raise_unexpected", "quiet"),
    ("log_all", "warned"), ("raise_all", "error"), ("ignore_all", "quiet")])
def test_a_tensor_the_model_does_not_load(tmp_path, capfd, strictness, outcome):
    root = str(tmp_path / "ck")
    _checkpoint(root, extra=True)
    [(kind, value)] = run_ranks(_load, 1, root, strictness, timeout=120)
    out = capfd.readouterr().out
    if outcome == "error":
        assert kind == "error" and EXTRA in value and "(missing)" in value
        return
    assert kind == "loaded", value
    warned = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert bool(warned) == (outcome == "warned"), out
    if warned:
        assert EXTRA in warned[0] and "(missing)" in warned[0]


def test_unexpected_optimizer_moments_start_at_zero_and_values_are_megatrons():
    class _Shard:
        def __init__(self):
            self.views = [torch.full((2,), 7.0)]

    shards = {"model.a": _Shard(), "optim.a.exp_avg": _Shard(), "model.b": _Shard()}
    stored = {"model.b": None, "model.c": None}
    unexpected, missing = mismatches("log_all", shards, stored, world=False)
    assert (unexpected, missing) == (["model.a", "optim.a.exp_avg"], ["model.c"])
    moment = shards["optim.a.exp_avg"].views[0]
    warning = apply("log_all", shards, "ck", unexpected, missing)
    assert list(shards) == ["model.b"] and torch.equal(moment, torch.zeros(2))
    assert "model.a" in warning and "model.c" in warning
    base = tiny_flags(num_layers=2) + ["--micro-batch-size", "1", "--train-iters", "1", "--mock-data",
                                       "--vocab-size", "64", "--lr", "1e-3"]
    for value in ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                  "return_unexpected", "return_all", "ignore_all"):
        assert config_from_args(base + ["--dist-ckpt-strictness", value],
                                world_size=1).checkpoint.dist_ckpt_strictness == value
    with pytest.raises(ConfigError, match="--dist-ckpt-strictness: invalid choice: 'strict'"):
        config_from_args(base + ["--dist-ckpt-strictness", "strict"], world_size=1)
