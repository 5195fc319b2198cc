"""The step's small collectives after its backward: which groups each layout reduces over, priced at
their latency (an all-reduce of a group of 2 is 2 alpha of the measured profile's entry)."""

import dataclasses

import pytest

from megafab.plan.machines import BUILTIN
from megafab.plan.planner import plan
from megafab.plan.step_syncs import step_sync_seconds
from megafab.plan.step_time import predict
from tests.helpers.flags import planned_gpt

ALPHA = 1e-3
CPU = dataclasses.replace(BUILTIN["h100-sxm-80gb"], compute_slots=2,
                          collectives={"all_reduce": {"2": [ALPHA, 1e15], "4": [ALPHA, 1e15]}})


@pytest.mark.parametrize("extra, world, calls", [
    ([], 1, 0),  # nothing to reduce with
    ([], 2, 1),  # DP 2: the loss
    (["--use-distributed-optimizer"], 2, 2),  # + the norm over the shards
    (["--tensor-model-parallel-size", "2"], 2, 1),  # the norm over TP
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 2),  # + SP's norm weights
    (["--pipeline-model-parallel-size", "2"], 2, 2),  # the norm over PP + the tied embeddings
    (["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"], 2, 1),
    (["--pipeline-model-parallel-size", "2", "--fp16"], 2, 3),  # + fp16's non-finite check
], ids=["world1", "dp2", "distopt", "tp2", "tp2-sp", "pp2", "pp2-untied", "pp2-fp16"])
def test_each_layout_reduces_over_its_groups(extra, world, calls):
    cfg = planned_gpt(extra, world)
    assert step_sync_seconds(cfg, CPU) == pytest.approx(calls * 2 * ALPHA, rel=1e-6)


def test_the_syncs_are_in_the_predicted_step():
    cfg = planned_gpt(["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2)
    with_syncs = predict(cfg, CPU, plan(cfg))
    assert with_syncs.breakdown["step_syncs"] == pytest.approx(4 * ALPHA, rel=1e-6)
