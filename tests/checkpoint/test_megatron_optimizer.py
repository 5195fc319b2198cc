"""Optimizer state in Megatron torch_dist checkpoints, both ways (megatron-core 0.16.1's
ShardedTensor machinery as the oracle: make_sharded_optimizer_tensor, the call its optimizers use):
its plain-optimizer and fully_reshardable distributed-optimizer tensors resume in megafab at other
layouts; a bucket-space state megafab does not read (dp_zero_gather_scatter; a dp_reshardable one
without its bucket buffers) is refused by name and --no-load-optim loads the rest; megafab's
distributed-optimizer state reads back in megatron-core tensor for tensor."""

import pytest
import torch
from megatron.core.dist_checkpointing import load as mcore_load
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

from megafab.checkpoint import checkpointing
from megafab.checkpoint.layout import from_stored
from megafab.checkpoint.megatron_dist import TorchDistSource
from megafab.param_names import VOCAB_PADDED
from megafab.run.fork_ranks import run_ranks
from tests.helpers import mcore
from tests.helpers.checkpoint import make_state, train
from tests.helpers.tiny import LLAMA_STYLE, tiny_config

# The saved optimizer state is a function of the weights, so any layout can check what it loaded.
MOMENTS = {"exp_avg": lambda w: 0.5 * w + 0.01, "exp_avg_sq": lambda w: w * w + 1e-3,
           "param": lambda w: w + 1e-3}
SCHEDULER = {"max_lr": 1e-3, "lr_warmup_steps": 0, "num_steps": 40, "lr_decay_style": "linear",
             "lr_decay_steps": 400, "min_lr": 0.0, "start_wd": 0.01, "end_wd": 0.01,
             "wd_incr_style": "constant", "wd_incr_steps": 400}


def _model_tensors(sharded):
    return {k: v for k, v in sharded.items() if not isinstance(v, ShardedObject)}


def _mcore_save_with_optimizer(rank, world, root, sharding):
    mcore.init_parallel(tp=world)
    m = tiny_config(tp=world, style=LLAMA_STYLE).model
    model = mcore.gpt_model(m)
    kinds = ["exp_avg", "exp_avg_sq"] + (["param"] if sharding else [])
    optimizer_state = {f"{kind}.{k}": make_sharded_optimizer_tensor(sh, MOMENTS[kind](sh.data.detach()),
                                                                     f"optimizer.state.{kind}")
                       for k, sh in _model_tensors(model.sharded_state_dict()).items() for kind in kinds}
    common_optimizer = {"optimizer": {"param_groups": [{"step": 7, "lr": 1e-3}]}}
    if sharding:
        common_optimizer["param_state_sharding_type"] = sharding
    else:  # megatron-core's FP32Optimizer keeps one common step
        common_optimizer = {"state": {"common_step": 7}, "param_groups": [{"lr": 1e-3}]}
    common = {"args": mcore.megatron_args(m, world, 1), "iteration": 10, "checkpoint_version": 3.0,
              "opt_param_scheduler": SCHEDULER, "optimizer": common_optimizer}
    mcore.save(model, root, common={**common, "optimizer_state": optimizer_state})


def _real_vocab_rows(state, entry):
    """Mask of the entry's elements outside the padding rows of the vocabulary."""
    p = entry.model_param
    lo, hi = entry.param_range or (0, p.numel())
    if entry.name not in VOCAB_PADDED:
        return torch.ones(hi - lo, dtype=torch.bool).view(entry.main.shape)
    rows = torch.arange(lo, hi) // p.shape[1] + state.topology.tp_rank * p.shape[0]
    return (rows < state.cfg.model.vocab_size).view(entry.main.shape)


def _resume(rank, world, root, tp, dist_opt, no_load_optim=False):
    state = make_state(tp=tp, dp=world // tp, dist_opt=dist_opt, style=LLAMA_STYLE, dtype=torch.float32,
                       load=root, no_load_optim=no_load_optim, global_batch_size=4,
                       use_checkpoint_opt_param_scheduler=True)  # megatron-core's run had its own schedule
    assert checkpointing.load_checkpoint(state) == 10
    worst = 0.0
    for e in state.optimizer.entries:
        adam = state.optimizer.optimizer.state.get(e.main)
        if no_load_optim:
            assert not adam
            continue
        w = e.model_values().reshape(e.main.shape)
        real = _real_vocab_rows(state, e)  # padding rows of a resharded vocabulary start at zero
        for kind in ("exp_avg", "exp_avg_sq"):
            worst = max(worst, (adam[kind] - MOMENTS[kind](w))[real].abs().max().item())
        assert float(adam["step"]) == 7.0
    return worst, state.iteration, state.consumed_train_samples, state.scheduler.num_samples


@pytest.mark.parametrize("sharding", [None, "fully_reshardable"])
def test_megatron_optimizer_state_resumes_in_megafab_at_other_layouts(tmp_path, sharding):
    root = str(tmp_path / "mcore")
    run_ranks(_mcore_save_with_optimizer, 2, root, sharding, timeout=240)
    for world, tp, dist_opt in ((2, 2, False), (2, 1, True)):
        for worst, iteration, consumed, samples in run_ranks(_resume, world, root, tp, dist_opt, timeout=240):
            assert worst < 1e-6 and (iteration, consumed, samples) == (10, 40, 40), (sharding, tp, dist_opt)


@pytest.mark.parametrize("sharding", ["dp_zero_gather_scatter", "dp_reshardable"])
def test_an_unread_bucket_state_is_refused_by_name_and_no_load_optim_loads_the_rest(tmp_path, sharding):
    """(Megatron's dp_reshardable buckets are read: test_megatron_dp_reshardable.py; this one
    records the type but holds parameter-shaped tensors, no `optimizer.distributed.*` buckets.)"""
    root = str(tmp_path / "mcore")
    run_ranks(_mcore_save_with_optimizer, 1, root, sharding, timeout=240)
    with pytest.raises(Exception, match=f"'{sharding}'.*--no-load-optim"):
        run_ranks(_resume, 1, root, 1, False, timeout=240)
    [(_, iteration, consumed, _)] = run_ranks(_resume, 1, root, 1, False, True, timeout=240)
    assert (iteration, consumed) == (10, 40)


def _megafab_train_and_save(rank, world, root):
    state = make_state(tp=2, dp=2, dist_opt=True, style=LLAMA_STYLE, dtype=torch.bfloat16, save=root)
    train(state, 2)
    checkpointing.save_checkpoint(state)


def _mcore_reads_optimizer(rank, world, path):
    mcore.init_parallel(tp=world)
    model = mcore.gpt_model(tiny_config(tp=2, style=LLAMA_STYLE).model, dtype=torch.bfloat16)
    wanted = {f"{kind}.{k}": make_sharded_optimizer_tensor(sh, torch.zeros_like(sh.data, dtype=torch.float32),
                                                           f"optimizer.state.{kind}")
              for k, sh in _model_tensors(model.sharded_state_dict()).items()
              for kind in ("param", "exp_avg", "exp_avg_sq")}
    loaded = mcore_load({"optimizer_state": wanted}, path)["optimizer_state"]
    return {k: v.clone() for k, v in loaded.items()}


def test_megafab_distributed_optimizer_state_reads_in_megatron_core(tmp_path):
    root = str(tmp_path / "megafab")
    run_ranks(_megafab_train_and_save, 4, root, timeout=240)
    path = str(tmp_path / "megafab" / "iter_0000002")
    loaded = run_ranks(_mcore_reads_optimizer, 1, path, timeout=240)[0]
    source = TorchDistSource(path)
    ours = source.read_all("optim.")
    kinds = {"param": "main_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    assert len(loaded) == len(ours) > 0
    for key, value in loaded.items():
        kind, name = key.split(".", 1)
        expected = from_stored(name, ours[f"optim.{name}.{kinds[kind]}"], source.model_cfg)
        assert torch.equal(value, expected), key
    assert source.step == 2.0
