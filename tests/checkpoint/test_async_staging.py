"""--async-save's host staging buffers (issue 40): the bytes each rank copies to host memory equal the
planner's `staging` term (megafab.plan.state_memory), which the plan's host bytes include; a second
save reuses the buffers; the staged copy is a snapshot, untouched by the training that follows."""

from __future__ import annotations

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.checkpoint import checkpointing
from megafab.checkpoint.async_save import AsyncSaver
from megafab.plan.planner import format_plan, plan
from megafab.plan.state_memory import state_bytes
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import make_state, train
from tests.helpers.flags import tiny_flags


def _staged(rank, world, root, dist_opt, dtype):
    state = make_state(tp=1, dp=2, dist_opt=dist_opt, dtype=dtype, save=root, async_save=True,
                       use_persistent_ckpt_worker=True)
    train(state, 1)
    saver = AsyncSaver()
    saver.schedule(state)
    buffers = {k: [t.data_ptr() for t in views] for k, views in saver.buffers.items()}
    key = next(k for k in saver.buffers if "exp_avg" in k)
    snapshot = saver.buffers[key][0].clone()
    train(state, 1)  # the optimizer steps while the writer writes: the staged copy stays as it was
    unchanged = torch.equal(saver.buffers[key][0], snapshot)
    assert saver.maybe_finalize(state.topology, blocking=True)
    staged = saver.staged_bytes()
    saver.schedule(state)
    reused = {k: [t.data_ptr() for t in views] for k, views in saver.buffers.items()} == buffers
    saver.maybe_finalize(state.topology, blocking=True)
    params = sum(p.numel() for chunk in state.model for p in chunk.parameters())
    planned = state_bytes(state.cfg, params, 0)
    return staged, planned.staging, planned.host, unchanged, reused, checkpointing.latest_iteration(root)


@pytest.mark.parametrize("dist_opt", [True, False], ids=["distributed optimizer", "DDP"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_staged_bytes_are_the_planned_ones(tmp_path, dist_opt, dtype):
    """fp32: weights 4 + Adam 8 bytes per parameter, bf16: 2 + fp32 main 4 + Adam 8, each over DP 2."""
    ranks = run_ranks(_staged, 2, str(tmp_path), dist_opt, dtype, timeout=120)
    for staged, planned, host, unchanged, reused, latest in ranks:
        assert planned > 0 and host >= planned
        assert abs(staged - planned) <= 0.01 * planned, (staged, planned)
        assert unchanged and reused and latest == 2


def test_the_plan_states_the_staging_bytes():
    """--dry-run's stage line names the async-save staging inside the host bytes (fp32: 4 + 8 bytes
    per parameter on one rank); without --async-save there is none."""
    base = tiny_flags(num_layers=2) + ["--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data",
                                       "--vocab-size", "64", "--lr", "1e-3", "--train-iters", "2",
                                       "--save", "s"]
    for extra, want in ((["--async-save", "--use-persistent-ckpt-worker"], True), ([], False)):
        cfg = config_from_args(base + extra, world_size=1)
        stages = plan(cfg)
        assert (stages[0].staging_bytes == 12 * stages[0].params) is want, stages[0].staging_bytes
        assert ("async-save staging" in format_plan(cfg, stages)) is want
