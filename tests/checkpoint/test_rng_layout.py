"""The layout a checkpoint records decides whether per-rank RNG states are restored: the expert grid
is part of it (EP 2 -> EP 4 on the same 4 ranks re-deals ranks), a dense run's record is unchanged."""

from megafab.checkpoint.source import run_layout


def test_expert_grid_is_part_of_the_recorded_layout():
    dense = run_layout(tp=2, pp=1, dp=2)
    assert dense == {"world_size": 4, "tp": 2, "pp": 1, "dp": 2, "vpp": 1}
    assert run_layout(2, 1, 2, ep=1, etp=2) == dense  # ETP = TP is a dense run's grid
    ep2, ep4 = run_layout(1, 1, 4, ep=2), run_layout(1, 1, 4, ep=4)
    assert ep2 != ep4 and ep2["ep"] == 2 and ep4["ep"] == 4
    assert run_layout(2, 1, 2, ep=2, etp=1) != run_layout(2, 1, 2, ep=2, etp=2)


def test_the_rank_order_is_part_of_the_recorded_layout():
    """--use-tp-pp-dp-mapping puts other coordinates on the same global ranks: the per-rank RNG files
    of one order are not restored into the other."""
    from megafab.layout import DEFAULT_ORDER, TP_PP_DP_ORDER

    assert run_layout(1, 2, 2, order=DEFAULT_ORDER) == run_layout(1, 2, 2)
    assert run_layout(1, 2, 2, order=TP_PP_DP_ORDER) != run_layout(1, 2, 2)
