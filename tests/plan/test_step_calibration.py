"""In-step collective calibration: the fit recovers the alphas that made the calibration steps, and
the step-time model prices per-layer and once-a-step collectives from their own entries."""

import copy
import dataclasses

import pytest

from megafab.arguments import config_from_args
from megafab.calibrate import steps as step_calibration
from megafab.calibrate.steps import (
    CALIBRATION_FLAGS,
    CALIBRATION_LAYOUTS,
    TERM_SUFFIX,
    fit_step_collectives,
)
from megafab.plan.collectives import collective_seconds, placement
from megafab.plan.machines import BUILTIN
from megafab.plan.planner import plan
from megafab.plan.step_time import predict

LOOP = {op: {"2": [4e-4, 8e8], "4": [9e-4, 6e8]}
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")}


def _cpu_like():
    return dataclasses.replace(BUILTIN["h100-sxm-80gb"], collectives=copy.deepcopy(LOOP), compute_slots=2)


def _true_alpha(world, group, term, ops):
    return {"alpha": 1e-3, "step_alpha": 5e-3, "fsdp_alpha": 2e-3}[term] * group / world + 2e-4 * len(ops)


def _rows_measured_on(truth):
    rows = []
    for world, group, ops, term, flags in CALIBRATION_LAYOUTS:
        cfg = config_from_args(CALIBRATION_FLAGS + flags, world_size=world)
        rows.append({"world": world, "group": group, "ops": list(ops), "term": term, "flags": flags,
                     "step_s": predict(cfg, truth, plan(cfg, "cpu")).step_time_s})
    return rows


def test_fit_recovers_each_layouts_alpha():
    truth = _cpu_like()
    for world, group, ops, term, _ in CALIBRATION_LAYOUTS:
        key = f"{group}@{world}" + TERM_SUFFIX[term]
        for op in ops:
            truth.collectives[op][key] = [_true_alpha(world, group, term, ops), LOOP[op][str(group)][1]]
    fitted = _cpu_like()
    fit_step_collectives(_rows_measured_on(truth), fitted)
    for op, table in truth.collectives.items():
        for key, (alpha, busbw) in table.items():
            assert fitted.collectives[op][key][0] == pytest.approx(alpha, rel=1e-6, abs=1e-9), (op, key)
            assert fitted.collectives[op][key][1] == busbw


def test_a_step_faster_than_the_model_without_collectives_fits_zero():
    rows = _rows_measured_on(_cpu_like())
    for row in rows:
        row["step_s"] = 1e-9
    fitted = _cpu_like()
    fit_step_collectives(rows, fitted)
    assert fitted.collectives["all_reduce"]["2@2"][0] == 0.0
    assert fitted.collectives["all_reduce"]["2@2:step"][0] == 0.0


def test_in_step_entries_take_precedence_and_the_loop_is_the_fallback():
    machine = _cpu_like()
    machine.collectives["all_reduce"]["2@4"] = [2e-3, 8e8]
    machine.collectives["all_reduce"]["2@4:step"] = [7e-3, 8e8]
    in_world_4 = placement(4, 2, 1, 1, machine.gpus_per_node, ("tp",))
    in_world_2 = placement(2, 2, 1, 1, machine.gpus_per_node, ("tp",))
    def seconds(where, suffix=""):
        return collective_seconds(machine, "all_reduce", 8e8, where, suffix)  # 1 s of bytes

    assert seconds(in_world_4) == pytest.approx(1 + 2 * 2e-3)
    assert seconds(in_world_4, ":step") == pytest.approx(1 + 2 * 7e-3)
    assert seconds(in_world_2) == pytest.approx(1 + 2 * 4e-4)  # no "2@2": the loop's "2"
    assert seconds(in_world_2, ":step") == pytest.approx(1 + 2 * 4e-4)


def test_the_data_parallel_reduction_is_priced_by_the_step_entry():
    cfg = config_from_args(CALIBRATION_FLAGS, world_size=2)  # DP 2, DDP: one all-reduce a step
    machine = _cpu_like()
    machine.collectives["all_reduce"]["2@2"] = [4e-4, 8e8]
    before = predict(cfg, machine, plan(cfg, "cpu")).breakdown["dp_comm"]
    machine.collectives["all_reduce"]["2@2:step"] = [4e-4 + 5e-3, 8e8]
    after = predict(cfg, machine, plan(cfg, "cpu")).breakdown["dp_comm"]
    assert after - before == pytest.approx(2 * 5e-3, rel=1e-6)  # 2 (n-1) ring steps of alpha


def test_fsdp2_gathers_are_priced_by_their_own_entry():
    cfg = config_from_args(CALIBRATION_FLAGS + ["--use-torch-fsdp2"], world_size=2)
    machine = _cpu_like()
    for op in ("all_gather", "reduce_scatter"):
        machine.collectives[op]["2@2"] = [4e-4, 8e8]
    before = predict(cfg, machine, plan(cfg, "cpu"))
    machine.collectives["all_gather"]["2@2:fsdp"] = [4e-4 + 1e-3, 8e8]
    after = predict(cfg, machine, plan(cfg, "cpu"))
    # 2 micro-batches a rank (global batch 4 over DP 2), each gathering the root and the 2 layers'
    # 3 groups in forward and (resharded after forward, all but the root) again in backward:
    # 2 x (7 + 6) gathers, 1 ring step each; the reduce-scatters keep the "2@2" entry
    extra = 2 * 13 * 1e-3
    assert after.breakdown["fsdp_gather"] - before.breakdown["fsdp_gather"] == pytest.approx(extra, rel=1e-6)
    assert after.step_time_s - before.step_time_s == pytest.approx(extra, rel=1e-6)


def test_speed_drift_is_the_median_ratio_of_the_worlds_rows_now_to_then(monkeypatch):
    machine = _cpu_like()
    machine.calibration_steps = [{"world": w, "group": g, "ops": list(ops), "term": term, "flags": flags,
                                  "step_s": 0.01 * (i + 1)}
                                 for i, (w, g, ops, term, flags) in enumerate(CALIBRATION_LAYOUTS)]
    then = [row for row in machine.calibration_steps if row["world"] == 2]
    slower = [1.0, 1.2, 1.5, 2.0, 3.0, 3.0]  # the median of these: 1.75
    assert len(then) == len(slower)

    def relaunched(layouts, rounds, timeout):
        assert rounds == 1 and [list(layout) for layout in layouts] == [
            [r["world"], r["group"], tuple(r["ops"]), r["term"], r["flags"]] for r in then]
        return [{**row, "step_s": row["step_s"] * k} for row, k in zip(then, slower)]

    monkeypatch.setattr(step_calibration, "_measured_rows", relaunched)
    assert step_calibration.speed_drift(machine, 2) == pytest.approx(1.75)
    machine.calibration_steps = []
    assert step_calibration.speed_drift(machine, 2) is None
