"""The driver's data iterators: Megatron's sample counts, --num-workers honoured, DP slices."""

from types import SimpleNamespace

import torch

from megafab.training.data_setup import build_data_iterators, sample_counts
from tests.harness import run_ranks
from tests.model.tiny import tiny_config


def _cfg(**overrides):
    return tiny_config(vocab_size=127, micro_batch_size=2, global_batch_size=4, train_iters=10,
                       eval_interval=5, eval_iters=2, dp=2, **overrides)


def test_megatron_sample_counts():
    assert sample_counts(_cfg(), 10) == (40, (10 // 5 + 1) * 2 * 4, 2 * 4)


def _first_batches(rank, world):
    firsts = []
    for workers in (0, 2):
        for dp_rank in (0, 1):
            cfg = _cfg(num_workers=workers)
            topo = SimpleNamespace(rank=dp_rank, dp_rank=dp_rank, dp=2)
            train, valid, test = build_data_iterators(cfg, topo, consumed_train_samples=0)
            assert train._num_workers == workers
            batch = next(train)
            assert batch["tokens"].shape == (2, cfg.model.seq_length)
            firsts.append(batch["tokens"])
    return firsts


def test_num_workers_flag_is_honoured_and_dp_ranks_get_different_samples():
    # one real process group (the index build synchronizes); DP ranks are simulated
    [firsts] = run_ranks(_first_batches, 1, timeout=120)
    assert not torch.equal(firsts[0], firsts[1])  # DP ranks read different samples
    assert torch.equal(firsts[0], firsts[2]) and torch.equal(firsts[1], firsts[3])  # workers change nothing
