import pytest
import torch.distributed as dist

from megafab.distributed.topology import (
    TopologyError,
    all_group_ranks,
    build_topology,
    grid_rank,
)
from megafab.launch import first_slurm_host, read_launch_env
from tests.harness import RankFailure, RankTimeout, run_ranks


def factorizations(world):
    return [(tp, pp) for tp in range(1, world + 1) for pp in range(1, world + 1)
            if world % (tp * pp) == 0]


def _groups_of_every_layout(rank, world):
    seen = {}
    for tp, pp in factorizations(world):
        topo = build_topology(tp=tp, pp=pp)
        dp = world // (tp * pp)
        t, d, p = topo.tp_rank, topo.dp_rank, topo.pp_rank
        assert rank == t + tp * (d + dp * p)
        # Membership and order straight from the formula, and what the groups really hold.
        assert topo.group_ranks["tp"] == [grid_rank(i, d, p, tp, dp) for i in range(tp)]
        assert topo.group_ranks["dp"] == [grid_rank(t, i, p, tp, dp) for i in range(dp)]
        assert topo.group_ranks["pp"] == [grid_rank(t, d, i, tp, dp) for i in range(pp)]
        kinds = ("tp", "dp", "pp", "mp") + (("embedding",) if p in (0, pp - 1) else ())
        assert topo.is_in_embedding_group == (p in (0, pp - 1))
        for kind in kinds:
            group = getattr(topo, f"{kind}_group")
            assert dist.get_process_group_ranks(group) == topo.group_ranks[kind], kind
            assert dist.get_world_size(group) == len(topo.group_ranks[kind])
        assert topo.is_first_stage == (p == 0) and topo.is_last_stage == (p == pp - 1)
        assert topo.next_pp_rank == grid_rank(t, d, (p + 1) % pp, tp, dp)
        assert topo.prev_pp_rank == grid_rank(t, d, (p - 1) % pp, tp, dp)
        # Real traffic: a sum over the TP group equals the sum of its members' ranks.
        import torch
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=topo.tp_group)
        assert x.item() == sum(topo.group_ranks["tp"])
        seen[(tp, pp)] = (t, d, p)
    return seen


def test_every_factorization_of_8_ranks_builds_megatron_order_groups():
    results = run_ranks(_groups_of_every_layout, 8, timeout=120)
    assert len(results[0]) == len(factorizations(8)) == 10


def test_16_rank_example_from_megatron_docstring():
    groups = all_group_ranks(16, tp=2, pp=4)
    assert groups["tp"][:3] == [[0, 1], [2, 3], [4, 5]]
    assert groups["dp"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert groups["embedding"][0] == [0, 12]


def test_layout_that_does_not_divide_the_world_is_refused_by_name():
    with pytest.raises(TopologyError, match="world size 8 is not divisible by .* 3"):
        all_group_ranks(8, tp=3, pp=1)


def test_slurm_fallback_reads_srun_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[003-004,010]", "SLURM_JOB_ID": "123456"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 16, 1)
    assert launch.master_addr == "gpu003" and launch.launcher == "slurm"
    assert launch.master_port == 10000 + 3456


def test_torchrun_variables_win_over_slurm():
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "MASTER_ADDR": "n1",
           "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.master_addr, launch.launcher) == (
        2, 4, "n1", "torchrun")


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("a[1-3]", "a1"),
                                            ("gpu[07,9],cpu1", "gpu07")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def _fail_on_rank_3(rank, world):
    if rank == 3:
        raise ValueError("deliberate failure on rank three")
    dist.barrier()  # the others wait for rank 3, which never arrives


def test_harness_reports_the_failing_rank():
    with pytest.raises(RankFailure, match=r"rank 3 of 4 failed first") as info:
        run_ranks(_fail_on_rank_3, 4, timeout=30)
    assert "deliberate failure on rank three" in str(info.value)


def _hang_on_rank_1(rank, world):
    if rank == 1:
        import time
        time.sleep(600)
    return rank


def test_harness_turns_a_hung_rank_into_a_timeout():
    import time
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"rank\(s\) \[1\] of 2 did not finish"):
        run_ranks(_hang_on_rank_1, 2, timeout=3)
    assert time.monotonic() - start < 15


def test_harness_returns_each_ranks_value():
    assert run_ranks(lambda r, w: r * 10, 3, timeout=30) == [0, 10, 20]
