"""The distributed optimizer's bucket all-gather on gloo runs in slices (gloo gathers into a flat
copy of the whole output): the same result as one all-gather, a bounded transient. And a dropped
DDP chunk is freed (its grad hooks do not keep it alive through the parameters' C++ metadata)."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist

from megafab.distributed import param_gather
from megafab.distributed.data_parallel import DistributedDataParallel
from megafab.run.fork_ranks import run_ranks


def _sliced_equals_whole(rank, world):
    param_gather.GLOO_SLICE = 7  # several slices and a short last one for a 40-element shard
    per_rank = 40
    g = torch.Generator().manual_seed(rank)
    mine = torch.randn(per_rank, generator=g, dtype=torch.float64)
    expected = torch.empty(world * per_rank, dtype=torch.float64)
    dist.all_gather_into_tensor(expected, mine)
    data = torch.full((world * per_rank,), float("nan"), dtype=torch.float64)
    data[rank * per_rank:(rank + 1) * per_rank] = mine  # the input is a view of the output, as in DDP
    handle, _ = param_gather.all_gather_bucket(data, world, rank, None, async_op=True)
    handle.wait()
    return torch.equal(data, expected)


def test_gloo_bucket_all_gather_in_slices_equals_one_call():
    assert run_ranks(_sliced_equals_whole, 3, timeout=60) == [True, True, True]


def _freed_after_del(rank, world):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    chunk = DistributedDataParallel(model, dp_group=None, use_distributed_optimizer=True)
    chunk(torch.randn(2, 8)).sum().backward()  # the grad hooks have run
    refs = [weakref.ref(chunk), weakref.ref(next(model.parameters()))]
    del chunk, model
    gc.collect()
    return [r() is None for r in refs]


def test_dropped_ddp_chunk_is_freed():
    assert run_ranks(_freed_after_del, 2, timeout=60) == [[True, True]] * 2


def _fsdp2_sliced_equals_whole(rank, world):
    from megafab.distributed import data_parallel
    from megafab.distributed.fsdp import local_tensor
    from tests.helpers.checkpoint import make_state, train

    gathers, runs = [], []
    in_slices = param_gather.all_gather_in_slices
    param_gather.all_gather_in_slices = lambda *a: gathers.append(1) or in_slices(*a)
    for slice_elements in (1 << 20, 256):  # whole, then several slices for most units
        param_gather.GLOO_SLICE = data_parallel.GLOO_SLICE = slice_elements
        state = make_state(tp=1, dp=2, dist_opt=False, use_torch_fsdp2=True, ddp_bucket_size=None)
        losses = train(state, 2)
        runs.append((losses, [local_tensor(p).clone() for p in state.model[0].parameters()]))
    (whole_losses, whole), (sliced_losses, sliced) = runs
    return bool(gathers), whole_losses == sliced_losses and all(map(torch.equal, whole, sliced))


def test_fsdp2_gloo_collectives_in_slices_train_as_whole_ones():
    assert run_ranks(_fsdp2_sliced_equals_whole, 2, timeout=120) == [(True, True)] * 2
