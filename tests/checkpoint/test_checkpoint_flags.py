"""Megatron's load-side flags: --ckpt-step picks an iteration, --pretrained-checkpoint fine-tunes
from another directory while --load holds none, --exit-on-missing-checkpoint stops instead of
training from scratch; flags megafab has no use for are announced, unimplemented ones refused."""

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.checkpoint import CheckpointError, checkpointing
from megafab.config import ConfigError
from megafab.convert import write_checkpoint
from megafab.model.gpt import GPTModel
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import GLOBAL_BATCH, make_state, train
from tests.helpers.flags import tiny_flags
from tests.helpers.tiny import context, tiny_config


def _weights(scale):
    cfg = tiny_config()
    model = GPTModel(cfg.model, context(dtype=torch.float64))
    return {k: v.detach() * scale for k, v in model.state_dict().items()}, cfg


def _loads(rank, world, **flags):
    state = make_state(tp=1, dp=1, dist_opt=False, **flags)
    try:
        iteration = checkpointing.load_checkpoint(state)
    except CheckpointError as e:
        return str(e)
    embedding = state.model[0].module.embedding.word_embeddings.weight
    return iteration, state.iteration, float(embedding.detach().abs().sum())


def test_ckpt_step_pretrained_checkpoint_and_exit_on_missing(tmp_path):
    root, empty = str(tmp_path / "ck"), str(tmp_path / "empty")
    sums = {}
    for iteration, scale in ((1, 1.0), (2, 2.0)):
        sd, cfg = _weights(scale)
        write_checkpoint(root, sd, cfg, iteration=iteration)
        sums[iteration] = float(sd["embedding.word_embeddings.weight"].abs().sum())
    [(it, resumed_at, total)] = run_ranks(_loads, 1, load=root, ckpt_step=1, finetune=True, timeout=120)
    assert it == 1 and abs(total - sums[1]) < 1e-9
    [(it, resumed_at, total)] = run_ranks(_loads, 1, load=empty, pretrained_checkpoint=root, timeout=120)
    assert (it, resumed_at) == (2, 0) and abs(total - sums[2]) < 1e-9  # fine-tuned from the latest
    [message] = run_ranks(_loads, 1, load=empty, exit_on_missing_checkpoint=True, timeout=120)
    assert "holds no checkpoint" in message and "--exit-on-missing-checkpoint" in message


def test_checkpoint_flags_without_use_are_announced_and_unimplemented_ones_refused():
    base = tiny_flags(num_layers=2) + [
        "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--vocab-size", "64", "--lr", "1e-3"]
    cfg = config_from_args([*base, "--ckpt-fully-parallel-load", "--dist-ckpt-optim-fully-reshardable",
                            "--dist-ckpt-strictness", "assume_ok_unexpected"], world_size=1)
    assert any("--dist-ckpt-optim-fully-reshardable" in n for n in cfg.no_effect)
    # Megatron's rules for --async-save: without --use-persistent-ckpt-worker it saves synchronously,
    # and only torch_dist saves asynchronously
    cfg = config_from_args([*base, "--save", "s", "--async-save"], world_size=1)
    assert not cfg.checkpoint.async_save and "disabling --async-save" in cfg.start_up_notes()[0]
    both = [*base, "--save", "s", "--async-save", "--use-persistent-ckpt-worker"]
    assert config_from_args(both, world_size=1).checkpoint.async_save
    with pytest.raises(ConfigError, match="--async-save with --ckpt-format torch: Megatron saves "
                                          "asynchronously only in torch_dist"):
        config_from_args([*both, "--ckpt-format", "torch", "--no-save-optim"], world_size=1)


def _resume_schedule(rank, world, root, **flags):
    saved = make_state(tp=1, dp=1, dist_opt=False, save=root, train_iters=4)
    train(saved, 2)
    checkpointing.save_checkpoint(saved)
    state = make_state(tp=1, dp=1, dist_opt=False, load=root, **flags)
    try:
        checkpointing.load_checkpoint(state)
    except CheckpointError as e:
        return str(e)
    s = state.scheduler
    return s.lr_decay_samples, s.num_samples, state.optimizer.param_groups[0]["lr"]


def test_a_schedule_that_differs_from_the_checkpoints_needs_a_flag_saying_which_wins(tmp_path):
    """Megatron's rule: --train-iters 6 against a checkpoint decaying over 4 iterations stops the run,
    unless --override-opt_param-scheduler (this command line) or --use-checkpoint-opt_param-scheduler
    (the checkpoint) says which schedule runs; the position in it is restored either way."""
    gbs = GLOBAL_BATCH
    [message] = run_ranks(_resume_schedule, 1, str(tmp_path / "a"), train_iters=6, timeout=120)
    assert "--override-opt_param-scheduler" in message and "--use-checkpoint-opt_param-scheduler" in message
    assert f"lr_decay_samples {6 * gbs} now" in message and f"{4 * gbs} in the checkpoint" in message
    assert "max_lr" not in message  # only what differs
    [(decay, seen, lr)] = run_ranks(_resume_schedule, 1, str(tmp_path / "b"), train_iters=6,
                                    override_opt_param_scheduler=True, timeout=120)
    assert (decay, seen) == (6 * gbs, 2 * gbs) and lr == pytest.approx(1e-2 * 4 / 6)
    [(decay, seen, lr)] = run_ranks(_resume_schedule, 1, str(tmp_path / "c"), train_iters=6,
                                    use_checkpoint_opt_param_scheduler=True, timeout=120)
    assert (decay, seen) == (4 * gbs, 2 * gbs) and lr == pytest.approx(1e-2 * 2 / 4)
    [(decay, seen, lr)] = run_ranks(_resume_schedule, 1, str(tmp_path / "d"), train_iters=4, timeout=120)
    assert (decay, seen) == (4 * gbs, 2 * gbs)  # the same schedule needs no flag


def test_both_schedule_flags_contradict():
    base = tiny_flags(num_layers=2) + [
        "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--vocab-size", "64", "--lr", "1e-3"]
    with pytest.raises(ConfigError, match="contradict"):
        config_from_args([*base, "--override-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"],
                         world_size=1)
