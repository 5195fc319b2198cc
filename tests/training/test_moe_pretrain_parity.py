"""pretrain_gpt.py --mock-data with a tiny MoE model (float32, 5 iterations): the iteration line,
metrics.jsonl and TensorBoard carry Megatron's balancing-loss names, and a parallel run logs the lm loss and
load_balancing_loss of one process within 1e-5 (sigmoid routing with the aux loss, the z-loss, a
shared expert and aux-loss-free expert biases updated from the tokens of all ranks). z_loss is not
compared across data-parallel ranks: Megatron logs the last rank's own value (its router log has
no reduce group)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import pretrain_in_ranks
from tests.helpers.moe_pretrain import MOE, assert_parity, logged
from tests.helpers.tiny_corpus import TINY

pytestmark = pytest.mark.slow  # ~20 s each on a loaded 2-core machine (three short runs in all)


@pytest.fixture(scope="module")
def single_process():
    return logged(pretrain_in_ranks(TINY + MOE, 1)[0])


def test_data_parallel_moe_logs_the_single_process_losses(tmp_path, single_process):
    """DP 2 with the distributed optimizer (the model built on the meta device, then filled)."""
    jsonl = tmp_path / "metrics.jsonl"
    flags = ["--use-distributed-optimizer", "--metrics-jsonl", str(jsonl), "--tensorboard-dir",
             str(tmp_path / "tb")]
    out = pretrain_in_ranks(TINY + MOE + flags, 2)[-1]
    ours = logged(out)
    assert_parity(ours, single_process)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    iterations = {r["iteration"]: r for r in records if r["kind"] == "iteration"}
    assert {it: r["load_balancing_loss"] for it, r in iterations.items()} == \
        pytest.approx({it: v[1] for it, v in ours.items()}, rel=1e-6)
    assert all("z_loss" in r for r in iterations.values())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"load_balancing_loss", "z_loss"} <= set(events.Tags()["scalars"])
    tb = {e.step: e.value for e in events.Scalars("load_balancing_loss")}
    assert tb == pytest.approx({it: v[1] for it, v in ours.items()}, rel=1e-6)


@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2"],  # dense layer 0 on stage 0, the MoE layer 1 on stage 1
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],  # expert TP = TP: experts sharded
    ["--context-parallel-size", "2"],  # the balancing losses' backward weight carries cp
], ids=["pp2", "tp2_sp", "cp2"])
def test_model_parallel_moe_logs_the_single_process_losses(single_process, layout):
    """The losses are summed over the stages and divided by the model's MoE layers (PP), counted
    over the TP / CP ranks' sequence shards (SP, CP), as Megatron's."""
    out = pretrain_in_ranks(TINY + MOE + layout, 2)[-1]
    assert_parity(logged(out), single_process)


@pytest.mark.parametrize("layout", [
    ["--expert-model-parallel-size", "2"],
    ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
     "--use-distributed-optimizer"],
], ids=["ep2_allgather", "ep2_alltoall_distopt"])
def test_expert_parallel_moe_logs_the_single_process_losses(single_process, layout):
    """EP 2 over the 2 DP ranks: each holds half the experts, their grads reduce over expert-DP."""
    out = pretrain_in_ranks(TINY + MOE + layout, 2)[-1]
    assert_parity(logged(out), single_process)
