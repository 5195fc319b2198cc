"""The distributed optimizer's bucket reduce-scatter on gloo runs in slices (gloo copies a
reduce-scatter's whole input): the same result as one reduce-scatter, a bounded transient."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megafab.distributed import data_parallel
from megafab.run.fork_ranks import run_ranks


def _sliced_equals_whole(rank, world):
    data_parallel.GLOO_SLICE = 7  # several slices and a short last one for a 40-element shard
    per_rank = 40
    g = torch.Generator().manual_seed(rank)
    # integers: exact sums in any order (gloo picks its algorithm by size, so the order may differ)
    data = torch.randint(-1000, 1000, (world * per_rank,), generator=g).double()
    expected = torch.empty(per_rank, dtype=torch.float64)
    dist.reduce_scatter_tensor(expected, data.clone())
    shard = data[rank * per_rank:(rank + 1) * per_rank]  # the output aliases the input, as in DDP
    handle = data_parallel.reduce_scatter_bucket(shard, data, dist.ReduceOp.SUM, None, async_op=True)
    handle.wait()
    return torch.equal(shard, expected)


def test_gloo_bucket_reduce_scatter_in_slices_equals_one_call():
    assert run_ranks(_sliced_equals_whole, 3, timeout=60) == [True, True, True]
