"""Megatron-LM's legacy torch format (mp_rank_XX[_YYY]/model_optim_rng.pt): files laid out as
megatron/training/checkpointing.py's generate_state_dict writes them, the model part from
megatron-core's own GPTModel.state_dict_for_save_checkpoint() at TP 2, load into megafab at TP 1 and
PP 2 with megatron-core's logits; a pickle payload inside a file does not run; megafab writes the
format back (--ckpt-format torch) and reads it at another layout."""

import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megafab.checkpoint import CheckpointError, checkpointing
from megafab.run.fork_ranks import run_ranks
from tests.helpers import mcore
from tests.helpers.checkpoint import full_logits, make_state, perturb
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, tiny_config

STYLES = {"gpt2": GPT2_STYLE, "llama": LLAMA_STYLE}
TOKENS = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(4))
PWNED = "/tmp/megafab_pwned_by_legacy_checkpoint"


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


def megatron_rng_state() -> list:
    """get_rng_state()'s list (CPU: the torch state stands in for the CUDA one)."""
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {}}]


def _mcore_legacy_save(rank, world, style, root, payload):
    mcore.init_parallel(tp=world)
    m = tiny_config(tp=world, style=STYLES[style]).model
    model = mcore.gpt_model(m)
    state = {"args": mcore.megatron_args(m, world, 1, ckpt_format="torch"), "checkpoint_version": 3.0,
             "iteration": 10, "model": model.state_dict_for_save_checkpoint(),
             "opt_param_scheduler": {"max_lr": 1e-3, "lr_warmup_steps": 0, "num_steps": 40,
                                     "lr_decay_style": "linear", "lr_decay_steps": 400, "min_lr": 0.0,
                                     "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant",
                                     "wd_incr_steps": 400},
             "rng_state": megatron_rng_state(), "num_floating_point_operations_so_far": 0}
    if payload:
        state["rerun_state_machine"] = Exploit()
    directory = os.path.join(root, "iter_0000010", f"mp_rank_{rank:02d}")
    os.makedirs(directory, exist_ok=True)
    torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("10")
    dist.barrier()
    return mcore.logits(model, TOKENS)


def _megafab_load(rank, world, style, root, tp, pp, finetune):
    state = make_state(tp=tp, pp=pp, dp=1, dist_opt=False, style=STYLES[style], dtype=torch.float32,
                       load=root, finetune=finetune, no_load_optim=True,
                       use_checkpoint_opt_param_scheduler=True)  # megatron-core's run had its own schedule
    assert checkpointing.load_checkpoint(state) == 10
    assert finetune or state.scheduler.max_lr == pytest.approx(1e-3)  # the checkpoint's --lr
    return full_logits(state, TOKENS), state.iteration, state.consumed_train_samples


@pytest.mark.parametrize("style", sorted(STYLES))
def test_legacy_checkpoint_at_tp2_loads_into_megafab_tp1_and_pp2(tmp_path, style):
    root = str(tmp_path / "legacy")
    expected = run_ranks(_mcore_legacy_save, 2, style, root, False, timeout=240)[0]
    vocab = tiny_config().model.vocab_size
    for tp, pp, finetune in ((1, 1, False), (1, 2, True)):
        logits, iteration, consumed = run_ranks(_megafab_load, tp * pp, style, root, tp, pp, finetune,
                                                timeout=240)[-1]
        err = (logits[..., :vocab] - expected[..., :vocab]).abs().max().item()
        assert err < 1e-5, (style, tp, pp, err)
        # resumed: Megatron's iteration and consumed samples; fine-tuned: from 0
        assert (iteration, consumed) == ((0, 0) if finetune else (10, 40))


def _load_expecting_error(rank, world, root, **flags):
    state = make_state(tp=1, dp=1, dist_opt=False, style=GPT2_STYLE, dtype=torch.float32, load=root, **flags)
    with pytest.raises(CheckpointError) as info:
        checkpointing.load_checkpoint(state)
    return str(info.value)


def test_a_pickle_payload_in_a_legacy_file_does_not_run(tmp_path):
    if os.path.exists(PWNED):
        os.remove(PWNED)
    root = str(tmp_path / "legacy")
    run_ranks(_mcore_legacy_save, 2, "gpt2", root, True, timeout=240)
    [message] = run_ranks(_load_expecting_error, 1, root, finetune=True, timeout=120)
    assert "posix.system" in message and "refusing to unpickle" in message, message
    assert not os.path.exists(PWNED)


def test_legacy_optimizer_state_is_refused_by_name(tmp_path):
    root = str(tmp_path / "legacy")
    run_ranks(_mcore_legacy_save, 1, "gpt2", root, False, timeout=240)
    path = os.path.join(root, "iter_0000010", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)
    state["optimizer"] = {"optimizer": {"state": {}, "param_groups": []}}
    torch.save(state, path)
    [message] = run_ranks(_load_expecting_error, 1, root, timeout=120)
    assert "legacy torch format keeps the optimizer state" in message and "--no-load-optim" in message


def _megafab_legacy_round_trip(rank, world, root):
    saver = make_state(tp=2, pp=2, dp=1, dist_opt=False, style=LLAMA_STYLE, dtype=torch.float32, save=root,
                       ckpt_format="torch", no_save_optim=True)
    perturb(saver)
    saver.iteration, saver.consumed_train_samples = 3, 12
    checkpointing.save_checkpoint(saver)
    return full_logits(saver, TOKENS)


def _megafab_legacy_load(rank, world, root):
    state = make_state(tp=1, dp=2, dist_opt=True, style=LLAMA_STYLE, dtype=torch.float32, load=root,
                       ckpt_format="torch")
    assert checkpointing.load_checkpoint(state) == 3
    return full_logits(state, TOKENS), state.consumed_train_samples


def test_megafab_writes_the_legacy_format_and_reads_it_at_another_layout(tmp_path):
    root = str(tmp_path / "legacy")
    expected = run_ranks(_megafab_legacy_round_trip, 4, root, timeout=240)[-1]
    names = sorted(os.listdir(os.path.join(root, "iter_0000003")))
    assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001", "rng"]
    got, consumed = run_ranks(_megafab_legacy_load, 2, root, timeout=240)[0]
    vocab = tiny_config().model.vocab_size
    assert (got[..., :vocab] - expected[..., :vocab]).abs().max().item() < 1e-6 and consumed == 12


def _legacy_split_save(rank, world, root, split):
    saver = make_state(tp=1, pp=2, dp=1, dist_opt=False, style=GPT2_STYLE, dtype=torch.float32, save=root,
                       ckpt_format="torch", no_save_optim=True, **split)
    perturb(saver)
    checkpointing.save_checkpoint(saver)
    return {n: p.detach().clone() for chunk in saver.model for n, p in chunk.module.named_parameters()}


def _legacy_vpp_load(rank, world, root):
    state = make_state(tp=1, dp=1, dist_opt=False, style=GPT2_STYLE, dtype=torch.float32, load=root,
                       ckpt_format="torch")
    checkpointing.load_checkpoint(state)
    return {n: p.detach().clone() for n, p in state.model[0].module.named_parameters()}


@pytest.mark.parametrize("split, last_stage_models", [
    ({"num_layers_per_virtual_pipeline_stage": 1}, {"model0": 1, "model1": 1}),  # layers 1 and 3
    ({"decoder_first_pipeline_num_layers": 1}, {"model": 3}),  # uneven: layers 1, 2, 3
])
def test_legacy_files_of_virtual_or_uneven_stages_read_back_at_pp1(tmp_path, split, last_stage_models):
    root = str(tmp_path / "legacy")
    saved = {}
    for part in run_ranks(_legacy_split_save, 2, root, split, timeout=240):
        saved.update(part)
    state = torch.load(os.path.join(root, "iter_0000000", "mp_rank_00_001", "model_optim_rng.pt"),
                       weights_only=False)
    layers = {key: len({n.split(".")[2] for n in state[key] if n.startswith("decoder.layers.")})
              for key in last_stage_models}
    assert layers == last_stage_models
    loaded = run_ranks(_legacy_vpp_load, 1, root, timeout=240)[0]
    assert sorted(loaded) == sorted(n for n in saved if n != "output_layer.weight")  # tied: one copy
    for name, tensor in loaded.items():
        assert torch.equal(tensor, saved[name]), name
