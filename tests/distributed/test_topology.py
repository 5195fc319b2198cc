import pytest
import torch.distributed as dist

from megafab.distributed.topology import (
    GROUP_AXES,
    Layout,
    TopologyError,
    all_group_ranks,
    build_topology,
    group_name,
)
from megafab.run.fork_ranks import RankFailure, RankTimeout, run_ranks
from megafab.run.launch import first_slurm_host, read_launch_env


def factorizations(world):
    return [(tp, pp) for tp in range(1, world + 1) for pp in range(1, world + 1)
            if world % (tp * pp) == 0]


def grid_rank(tp_rank, dp_rank, pp_rank, tp, dp):
    return tp_rank + tp * (dp_rank + dp * pp_rank)


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
        assert topo.is_in_embedding_group == (p in (0, pp - 1))
        groups = {kind: topo.group(*kind.split("-")) for kind in ("tp", "dp", "pp", "tp-pp")}
        if p in (0, pp - 1):
            groups["embedding"] = topo.embedding_group()
        for kind, group in groups.items():
            assert dist.get_process_group_ranks(group) == topo.group_ranks[kind], kind
            assert dist.get_world_size(group) == len(topo.group_ranks[kind])
        assert topo.is_first_stage == (p == 0) and topo.is_last_stage == (p == pp - 1)
        assert topo.next_pp_rank == grid_rank(t, d, (p + 1) % pp, tp, dp)
        assert topo.prev_pp_rank == grid_rank(t, d, (p - 1) % pp, tp, dp)
        # Real traffic: a sum over the TP group equals the sum of its members' ranks.
        import torch
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=topo.group("tp"))
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


# ---- named axes (context parallel) ---------------------------------------------------------------
def _layouts(world):
    return [(tp, cp, pp) for tp in (1, 2, 4) for cp in (1, 2, 4) for pp in (1, 2, 4)
            if world % (tp * cp * pp) == 0]


@pytest.mark.parametrize("world", [8, 16])
def test_every_group_is_the_ranks_that_agree_on_the_other_axes(world):
    for tp, cp, pp in _layouts(world):
        layout = Layout(world, tp=tp, cp=cp, pp=pp)
        assert layout.dp == world // (tp * cp * pp)
        coords = [layout.coords(r) for r in range(world)]
        # tp-cp-ep-dp-pp at EP 1, TP fastest
        assert all(layout.rank(**c) == r for r, c in enumerate(coords))
        assert all(r == c["tp"] + tp * (c["cp"] + cp * (c["dp"] + layout.dp * c["pp"]))
                   for r, c in enumerate(coords))
        for axes in GROUP_AXES:
            groups = layout.groups(*axes)
            assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
            for g in groups:
                grid = layout.grid(axes)
                others = {(a, coords[g[0]][a]) for a in grid if a not in axes}
                assert g == [r for r in range(world) if others <= set(coords[r].items())]
            assert groups == layout.groups(*reversed(axes))  # names, not their order, decide


def test_cp_groups_of_an_8_rank_tp2_cp2_pp2_grid():
    groups = all_group_ranks(8, tp=2, pp=2, cp=2)
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert groups["cp-dp"] == groups["cp"]
    assert groups["tp-cp-dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["pp"][:2] == [[0, 4], [1, 5]]
    assert groups["tp-pp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # CP replicas are not in it


def test_layout_with_cp_that_does_not_divide_the_world_is_refused_by_name():
    with pytest.raises(TopologyError, match="world size 8 is not divisible by .*context-parallel-size 3"):
        all_group_ranks(8, tp=1, pp=1, cp=3)
    with pytest.raises(TopologyError, match="unknown parallel axis 'xp'"):
        Layout(8).groups("xp")


def _cp_groups(rank, world, tp, cp, pp):
    topo = build_topology(tp=tp, pp=pp, cp=cp)
    layout = Layout(world, tp=tp, cp=cp, pp=pp)
    assert topo.cp_rank == layout.coords(rank)["cp"] and topo.dp == layout.dp
    import torch

    for axes in GROUP_AXES:
        group = topo.group(*reversed(axes))
        mine = next(g for g in layout.groups(*axes) if rank in g)
        assert group is topo.group(*axes)
        assert dist.get_process_group_ranks(group) == mine == topo.group_ranks[group_name(axes)]
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=group)
        assert x.item() == sum(mine)
    assert topo.group("ep", "dp", "cp") is topo.group("dp", "cp")  # ep is an axis of size 1
    return f"cp {topo.cp_rank}/{topo.cp}"


@pytest.mark.parametrize("tp,cp,pp", [(2, 2, 2), (1, 2, 2), (1, 4, 1)])
def test_groups_by_axis_names_are_real_process_groups(tp, cp, pp):
    described = run_ranks(_cp_groups, 8, tp, cp, pp, timeout=120)
    assert f"cp 1/{cp}" in described[tp]


def test_groups_are_looked_up_by_axis_names_only():
    """No module reads a group as a topology attribute (topo.dp_group, ...): topo.group(*axes) is
    the one accessor, so a layout's groups are named in one way everywhere."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "megafab"
    attribute = re.compile(r"\b(topo|topology)\.(?!is_in_embedding_group\b)\w+_group\b(?!\()")
    reads = [f"{path.relative_to(root)}:{n}" for path in root.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if attribute.search(line)]
    assert reads == []
