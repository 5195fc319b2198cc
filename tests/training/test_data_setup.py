"""The driver's data iterators: Megatron's sample counts, --num-workers honoured, DP slices."""

from types import SimpleNamespace

import torch

from megafab.run.fork_ranks import run_ranks
from megafab.training.data_setup import build_data_iterators, sample_counts
from tests.helpers.tiny import tiny_config


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


def _cp_ranks_read_the_same_samples(rank, world):
    import torch.distributed as dist

    from megafab.distributed.topology import build_topology
    from megafab.training.step import get_batch_on_this_cp_rank

    cfg = tiny_config(vocab_size=127, micro_batch_size=2, global_batch_size=4, train_iters=10,
                      eval_interval=5, eval_iters=2, dp=4, num_workers=0,
                      context_parallel_size=2)  # world 4 = CP 2 x DP 2
    assert cfg.parallel.data_parallel_size == 2
    topo = build_topology(cp=2)
    train, _, _ = build_data_iterators(cfg, topo, consumed_train_samples=0)
    batch = next(train)
    mine = get_batch_on_this_cp_rank(batch, topo.group("cp"))
    pieces = [torch.empty_like(mine["tokens"]) for _ in range(2)]
    dist.all_gather(pieces, mine["tokens"].contiguous(), group=topo.group("cp"))
    c = cfg.model.seq_length // 4  # CP rank r holds chunks r and 3 - r of 4
    whole = torch.cat([pieces[0][:, :c], pieces[1][:, :c], pieces[1][:, c:], pieces[0][:, c:]], dim=1)
    return topo.dp_rank, batch["tokens"], torch.equal(whole, batch["tokens"]), mine["position_ids"]


def test_cp_ranks_of_a_dp_rank_read_the_same_samples_and_keep_their_chunks():
    results = run_ranks(_cp_ranks_read_the_same_samples, 4, timeout=120)
    by_dp = {}
    for dp_rank, tokens, tiles, positions in results:
        assert tiles  # the CP ranks' chunks reassemble the sample
        by_dp.setdefault(dp_rank, []).append(tokens)
        assert positions.shape[1] == tokens.shape[1] // 2
    assert all(torch.equal(a, b) for a, b in by_dp.values())  # same samples on both CP ranks
    assert not torch.equal(by_dp[0][0], by_dp[1][0])  # the sampler still splits over DP only
    assert results[0][3][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]  # seq 16: chunks 0 and 3
