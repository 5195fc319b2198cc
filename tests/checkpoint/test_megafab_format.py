"""megafab's earlier checkpoint format (common.json + DCP files under model.* / optim.* keys, as
megafab wrote it before torch_dist) still loads: written here from its documented layout by
state.py's Shards, resumed at another TP size with the uninterrupted run's losses (float64)."""

import os

import torch

from megafab.checkpoint import checkpointing, dcp_io, directory
from megafab.checkpoint import state as cs
from megafab.checkpoint.source import rng_file
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import make_state, train


def _write_megafab_format(state, root):
    tmp = directory.iteration_dir(root, state.iteration) + ".tmp"
    os.makedirs(os.path.join(tmp, "rng"))
    shards = {**cs.model_shards_for_save(state), **cs.optimizer_shards_for_save(state)}
    dcp_io.save_shards(shards, tmp)
    torch.save(cs.rng_snapshot(state), rng_file(tmp, 0))
    record = checkpointing.common_record(state, True).to_dict()
    directory.write_json(os.path.join(tmp, directory.COMMON), record)
    directory.commit_checkpoint(root, state.iteration)


def _straight(rank, world, root):
    state = make_state(tp=1, dp=1, dist_opt=False, vocab_size=128)  # padded alike at TP 1 and 2
    train(state, 2)
    _write_megafab_format(state, root)
    return train(state, 2)


def _resume_at_tp2(rank, world, root):
    state = make_state(tp=2, dp=1, dist_opt=False, load=root, vocab_size=128)
    assert checkpointing.load_checkpoint(state) == 2 and state.consumed_train_samples == 8
    return train(state, 2)


def test_the_earlier_megafab_format_resumes_at_another_layout(tmp_path):
    root = str(tmp_path / "old")
    expected = run_ranks(_straight, 1, root, timeout=180)[0]
    got = run_ranks(_resume_at_tp2, 2, root, timeout=180)[0]
    assert os.path.isfile(os.path.join(root, "iter_0000002", "common.json"))
    for x, y in zip(got, expected):
        assert abs(x - y) <= 1e-10 * abs(y), (got, expected)
