"""MoE parallel folding: the expert grid (etp-ep-edp-pp) over the same ranks as the dense grid
(tp-cp-dp-pp), rank for rank megatron-core 0.16.1's two RankGenerators; and the same under
--use-tp-pp-dp-mapping's order tp-cp-ep-pp-dp, where Megatron's rule (equal DPs when PP > 1) holds."""

import pytest
import torch
import torch.distributed as dist

from megafab.distributed.topology import (
    GROUP_AXES,
    Layout,
    TopologyError,
    all_group_ranks,
    build_topology,
    group_name,
    layout_problems,
)
from megafab.layout import DEFAULT_ORDER, TP_PP_DP_ORDER
from megafab.run.fork_ranks import run_ranks

# megafab's axes -> (which megatron RankGenerator, its token)
MEGATRON = {"tp": ("dense", "tp"), "cp": ("dense", "cp"), "dp": ("dense", "dp"),
            "pp": ("dense", "pp"), "cp-dp": ("dense", "dp-cp"), "tp-pp": ("dense", "tp-pp"),
            "tp-cp-dp": ("dense", "tp-dp-cp"), "tp-cp": ("dense", "tp-cp"),
            "ep": ("expert", "ep"), "etp": ("expert", "tp"), "etp-ep": ("expert", "tp-ep"),
            "etp-ep-pp": ("expert", "tp-ep-pp"), "edp": ("expert", "dp")}


def _layouts(world):
    """Every TP dividing the world; PP, CP, EP and ETP (None: = TP) from a few small sizes."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for tp in divisors:
        for pp in (1, 2, 4):
            for cp in (1, 2):
                if world % (tp * cp * pp):
                    continue
                for ep in (1, 2, 4, 8):
                    for etp in (None, 1, 2) if tp != 1 else (None, 2):
                        if world % ((etp or tp) * ep * pp) == 0:
                            yield tp, cp, pp, ep, etp


def _generators(world, tp, cp, pp, ep, etp, order=DEFAULT_ORDER):
    from megatron.core.parallel_state import RankGenerator

    etp = tp if etp is None else etp
    return {"dense": RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp,
                                   order=order),
            "expert": RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1,
                                    order=order)}


@pytest.mark.parametrize("order", [DEFAULT_ORDER, TP_PP_DP_ORDER])
def test_every_group_is_megatron_cores_rank_generator_for_worlds_1_to_32(order):
    pytest.importorskip("megatron.core")
    checked = 0
    for world in range(1, 33):
        for tp, cp, pp, ep, etp in _layouts(world):
            if layout_problems(world, tp, pp, cp, ep, etp, order):  # tp-pp-dp: Megatron's equal-DP rule
                assert order == TP_PP_DP_ORDER and pp > 1
                continue
            gens = _generators(world, tp, cp, pp, ep, etp, order)
            ours = all_group_ranks(world, tp, pp, cp, ep, etp, order)
            assert set(MEGATRON) == {group_name(a) for a in GROUP_AXES}
            for name, (grid, token) in MEGATRON.items():
                assert ours[name] == gens[grid].get_ranks(token), (world, tp, cp, pp, ep, etp, name)
            assert gens["dense"].get_ranks("pp") == gens["expert"].get_ranks("pp")
            checked += 1
    assert checked > (1000 if order == DEFAULT_ORDER else 500)  # every world size, many folds each


def test_tp_pp_dp_order_puts_pipeline_stages_before_replicas_and_keeps_megatrons_rule():
    layout = Layout(8, tp=2, pp=2, order=TP_PP_DP_ORDER)
    assert layout.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # default order: [0, 4], ...
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert Layout(8, tp=2, pp=2).groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    (problem,) = layout_problems(8, 2, 2, ep=2, etp=2, order=TP_PP_DP_ORDER)
    assert problem.startswith("--use-tp-pp-dp-mapping with --pipeline-model-parallel-size 2 needs the "
                              "expert grid's data-parallel size (world / (ETP x EP x PP) = 1) to equal")
    assert not layout_problems(8, 2, 2, ep=2, etp=1, order=TP_PP_DP_ORDER)  # ETP x EP = TP: allowed


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", [(8, 2, 2, 1, 4, 1), (16, 2, 1, 2, 2, None),
                                                   (12, 3, 1, 2, 2, 1), (8, 1, 2, 2, 2, 2)])
def test_coordinates_follow_both_formulas(world, tp, cp, pp, ep, etp):
    layout = Layout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    e = layout.etp
    assert layout.edp == world // (e * ep * pp) and layout.dp == world // (tp * cp * pp)
    for r in range(world):
        c = layout.coords(r)
        assert r == c["tp"] + tp * (c["cp"] + cp * (c["dp"] + layout.dp * c["pp"]))
        assert r == c["etp"] + e * (c["ep"] + ep * (c["edp"] + layout.edp * c["pp"]))
        assert layout.rank(**{a: c[a] for a in ("etp", "ep", "edp", "pp")}) == r
        assert layout.rank(**c) == r  # both grids' coordinates agree


def test_etp_defaults_to_tp_and_expert_dp_absorbs_cp():
    assert Layout(8, tp=2) == Layout(8, tp=2, etp=2)
    layout = Layout(8, tp=2, cp=2, ep=2, etp=1)  # dp 2; expert dp 8 / (1 * 2) = 4
    assert (layout.dp, layout.edp) == (2, 4)
    assert layout.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("etp") == [[r] for r in range(8)]
    assert layout.groups("ep", "edp") == [list(range(8))]


def test_axes_of_size_one_fold_away_and_mixed_grids_are_refused():
    dense_only = Layout(8, tp=2, pp=2)
    assert dense_only.groups("ep", "dp", "cp") == dense_only.groups("dp")
    assert dense_only.groups("etp") == dense_only.groups("tp")  # ETP = TP, EP 1
    with pytest.raises(TopologyError, match="dp belong to the dense grid .* ep to the expert"):
        Layout(8, ep=2).groups("ep", "dp")
    with pytest.raises(TopologyError, match="unknown parallel axis 'xp'.*etp-ep-edp-pp"):
        Layout(8).groups("xp")


def test_layout_problems_name_the_expert_flags_and_the_fix():
    assert layout_problems(8, tp=2, pp=1, ep=4, etp=1) == []
    (msg,) = layout_problems(8, tp=2, pp=2, ep=3)
    assert msg.startswith("world size 8 is not divisible by the expert grid "
                          "--expert-tensor-parallel-size 2 (= TP) x --expert-model-parallel-size 3 "
                          "x --pipeline-model-parallel-size 2 = 12")
    assert "launch a multiple of 12 processes" in msg
    (msg,) = layout_problems(8, tp=1, pp=1, ep=2, etp=3)
    assert "--expert-tensor-parallel-size 3 x --expert-model-parallel-size 2" in msg
    problems = layout_problems(8, tp=1, pp=1, ep=0, etp=0)
    assert problems == ["--expert-model-parallel-size is 0; it must be at least 1",
                        "--expert-tensor-parallel-size is 0; it must be at least 1"]
    assert layout_problems(8, tp=0, pp=1) == ["--tensor-model-parallel-size is 0; it must be at least 1"]
    (msg,) = layout_problems(6, tp=4, pp=1)  # a dense failure is not repeated for the expert grid
    assert "--tensor-model-parallel-size 4" in msg
    with pytest.raises(TopologyError, match="--expert-model-parallel-size 3"):
        Layout(8, ep=3)


def _expert_groups(rank, world, tp, cp, pp, ep, etp):
    topo = build_topology(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    layout = Layout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    assert (topo.size("ep"), topo.size("etp"), topo.size("edp")) == (ep, layout.etp, layout.edp)
    assert topo.rank_in("ep") == layout.coords(rank)["ep"] == topo.coord("ep")
    for axes in GROUP_AXES:
        group = topo.group(*reversed(axes))
        mine = next(g for g in layout.groups(*axes) if rank in g)
        assert dist.get_process_group_ranks(group) == mine == topo.group_ranks[group_name(axes)]
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=group)
        assert x.item() == sum(mine), group_name(axes)
    assert dist.get_rank(topo.group("ep")) == topo.rank_in("ep")
    return topo.group_ranks["ep"], topo.group_ranks["edp"], topo.group_ranks["etp"]


@pytest.mark.parametrize("tp,cp,pp,ep,etp", [(2, 1, 2, 2, 1), (2, 2, 1, 2, None), (1, 2, 1, 4, 2)])
def test_expert_groups_are_real_process_groups_on_8_ranks(tp, cp, pp, ep, etp):
    ranks = run_ranks(_expert_groups, 8, tp, cp, pp, ep, etp, timeout=120)
    layout = Layout(8, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    for kind, groups in zip(("ep", "edp", "etp"), zip(*ranks)):
        assert sorted(map(list, {tuple(g) for g in groups})) == layout.groups(kind)
    if (tp, pp, ep, etp) == (2, 2, 2, 1):  # written out: EP strides over ETP 1, PP stays last
        assert layout.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert layout.groups("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
