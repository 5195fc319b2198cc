"""pretrain_gpt.py --mock-data with the DeepSeek-V3 script's MoE benchmark flags: forced balanced
routing, per-layer balancing-loss logging (TensorBoard, Megatron's moe/<name>_layer_<i> tags, the
layer values adding up to the logged loss; the iteration line keeps only the totals), with
--dist-ckpt-strictness log_all and --enable-experimental accepted; over two pipeline stages (the
dense layer 0 on stage 0, the MoE layer 1 on stage 1)."""

from __future__ import annotations

import pytest

from tests.helpers.launch import pretrain_in_ranks
from tests.helpers.moe_pretrain import MOE, logged
from tests.helpers.tiny_corpus import TINY

pytestmark = pytest.mark.slow  # two short 2-rank runs


def test_forced_routing_and_per_layer_log(tmp_path):
    flags = ["--moe-router-force-load-balancing", "--moe-per-layer-logging", "--dist-ckpt-strictness",
             "log_all", "--enable-experimental", "--tensorboard-dir", str(tmp_path / "tb"),
             "--pipeline-model-parallel-size", "2"]
    out = pretrain_in_ranks(TINY + MOE + flags, 2)[-1]
    forced = logged(out)
    assert sorted(forced) == [1, 2, 3, 4, 5]
    assert "moe/" not in out  # the per-layer values go to TensorBoard only
    gate_routed = logged(pretrain_in_ranks(TINY + MOE + ["--pipeline-model-parallel-size", "2"], 2)[-1])
    assert forced[1][0] != gate_routed[1][0]  # other experts chose: another loss from the first step
    # uniform routing: the switch loss E/k * sum_i f_i P_i is 1 up to sampling noise
    assert all(abs(balancing - 1) < 0.1 for _, balancing, _ in forced.values()), forced
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("load_balancing_loss", "z_loss"):
        assert {f"moe/{name}_layer_0", f"moe/{name}_layer_1"} <= tags
        total = {e.step: e.value for e in events.Scalars(name)}
        dense = {e.step: e.value for e in events.Scalars(f"moe/{name}_layer_0")}
        moe_layer = {e.step: e.value for e in events.Scalars(f"moe/{name}_layer_1")}
        assert set(total) == set(moe_layer) == {1, 2, 3, 4, 5}
        assert all(v == 0 for v in dense.values())
        assert moe_layer == pytest.approx(total, rel=1e-5)  # one MoE layer: the layer's value is the total
    assert {it: v[1] for it, v in forced.items()} == \
        pytest.approx({e.step: e.value for e in events.Scalars("load_balancing_loss")}, rel=1e-5)
