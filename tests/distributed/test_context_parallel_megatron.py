"""megafab's rank grid and CP batch split against megatron-core 0.16.1's own functions."""

import pytest
import torch
import torch.distributed as dist

from megafab.distributed.topology import DENSE, GROUP_AXES, Layout
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import get_batch_on_this_cp_rank

parallel_state = pytest.importorskip("megatron.core.parallel_state")
megatron_utils = pytest.importorskip("megatron.core.utils")


@pytest.mark.parametrize("world", [8, 16])
def test_groups_equal_megatrons_rank_generator_for_tp_cp_ep_dp_pp(world):
    for tp in (1, 2, 4):
        for cp in (1, 2, 4):
            for pp in (1, 2):
                if world % (tp * cp * pp):
                    continue
                layout = Layout(world, tp=tp, cp=cp, pp=pp)
                megatron = parallel_state.RankGenerator(tp=tp, ep=1, dp=layout.dp, pp=pp, cp=cp,
                                                        order="tp-cp-ep-dp-pp")
                dense = [a for a in GROUP_AXES if set(a) <= set(DENSE)]  # expert: test_expert_topology
                for axes in dense:
                    token = "-".join(axes)
                    assert layout.groups(*axes) == megatron.get_ranks(token), (tp, cp, pp, token)


def _split_like_megatron(rank, world):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, 100, (2, 32), generator=g),
             "labels": torch.randint(0, 100, (2, 32), generator=g),
             "loss_mask": torch.rand(2, 32, generator=g),
             "position_ids": torch.arange(32).expand(2, 32)}
    ours = get_batch_on_this_cp_rank(dict(batch), group)
    theirs = megatron_utils.get_batch_on_this_cp_rank({k: v.clone() for k, v in batch.items()}, group)
    return all(torch.equal(ours[k], theirs[k]) for k in batch)


@pytest.mark.parametrize("cp", [2, 4])
def test_batch_split_equals_megatrons_get_batch_on_this_cp_rank(cp):
    assert all(run_ranks(_split_like_megatron, cp, timeout=60))
