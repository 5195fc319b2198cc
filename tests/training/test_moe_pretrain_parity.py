"""pretrain_gpt.py --mock-data with a tiny MoE model (float32, 5 iterations): the iteration line
and metrics.jsonl carry Megatron's balancing-loss names, and a parallel run logs the lm loss and
load_balancing_loss of one process within 1e-5. z_loss is not compared across data-parallel ranks:
Megatron logs the last rank's own value (its router log has no reduce group)."""

from __future__ import annotations

import json
import re

import pytest

from tests.training.launch import losses, pretrain_in_ranks
from tests.training.tiny_corpus import TINY

MOE = ["--mock-data", "--train-iters", "5", "--global-batch-size", "4", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-layer-freq", "([0]*1+[1]*1)", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
       "--moe-shared-expert-intermediate-size", "24"]
BALANCING = re.compile(r"iteration\s+(\d+)/.*? load_balancing_loss: (\S+) \| z_loss: (\S+) \|")
pytestmark = pytest.mark.slow  # ~20 s each on a loaded 2-core machine (three short runs in all)


def _logged(output: str) -> dict[int, tuple[float, float, float]]:
    lm = losses(output)
    return {int(m.group(1)): (lm[int(m.group(1))], float(m.group(2)), float(m.group(3)))
            for m in BALANCING.finditer(output)}


@pytest.fixture(scope="module")
def single_process():
    return _logged(pretrain_in_ranks(TINY + MOE, 1)[0])


def _assert_parity(ours, reference):
    assert sorted(ours) == sorted(reference) == [1, 2, 3, 4, 5]
    for it, (lm, balancing, z) in ours.items():
        ref_lm, ref_balancing, _ = reference[it]
        assert abs(lm - ref_lm) < 1e-5, (it, ours[it], reference[it])
        assert abs(balancing - ref_balancing) < 1e-5, (it, ours[it], reference[it])
        assert balancing > 0.5 and z > 0  # logged, not zeros


def test_data_parallel_moe_logs_the_single_process_losses(tmp_path, single_process):
    jsonl = tmp_path / "metrics.jsonl"
    out = pretrain_in_ranks(TINY + MOE + ["--metrics-jsonl", str(jsonl)], 2)[-1]
    _assert_parity(_logged(out), single_process)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    iterations = [r for r in records if r["kind"] == "iteration"]
    assert len(iterations) == 5 and all({"load_balancing_loss", "z_loss"} <= r.keys() for r in iterations)


@pytest.mark.xfail(strict=True, reason="expert gradients still average over DP, not expert-DP (the DDP "
                                       "helper's branch ddp23 reduces them in their own buckets)")
def test_expert_parallel_moe_logs_the_single_process_losses(single_process):
    out = pretrain_in_ranks(TINY + MOE + ["--expert-model-parallel-size", "2"], 2)[-1]
    _assert_parity(_logged(out), single_process)
