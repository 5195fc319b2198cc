"""pretrain_gpt.py --mock-data with --mtp-num-layers (float32, 4 iterations): the iteration line
carries each depth's MTP loss after the lm loss under Megatron's names (`mtp_1 loss: ... |`,
MTPLossLoggingHelper's), metrics.jsonl too, and PP 2 (MTP on the last stage, its embedding copy's
gradient summed with the first stage's), DP 2 with the distributed optimizer, DP 2 with FSDP2 and
CP 2 log the lm and MTP losses of one process within 1e-5; an MoE model's MTP layer (MoE too) under EP 2 and
PP 2 logs its lm, balancing and MTP losses."""

from __future__ import annotations

import json
import math
import re

from tests.helpers.launch import losses, pretrain_in_ranks
from tests.helpers.moe_pretrain import MOE
from tests.helpers.moe_pretrain import logged as balancing_logged
from tests.helpers.tiny_corpus import TINY

MTP = ["--mock-data", "--train-iters", "4", "--global-batch-size", "2", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--position-embedding-type", "rope", "--mtp-num-layers", "2",
       "--mtp-loss-scaling-factor", "0.5"]
LINE = re.compile(r"iteration\s+(\d+)/.*? lm loss: (\S+) \| mtp_1 loss: (\S+) \| mtp_2 loss: (\S+) \| "
                  r"loss scale")


MTP_ONLY = re.compile(r"iteration\s+(\d+)/.*? mtp_1 loss: (\S+) \| mtp_2 loss: (\S+) \|")


def logged(output: str) -> dict[int, tuple[float, float, float]]:
    return {int(m.group(1)): tuple(float(v) for v in m.groups()[1:]) for m in LINE.finditer(output)}


def moe_logged(output: str) -> dict[int, tuple[float, ...]]:
    """(lm loss, load_balancing_loss, mtp_1 loss, mtp_2 loss) per iteration of an MoE run's log."""
    mtp = {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in MTP_ONLY.finditer(output)}
    return {it: (lm, balancing, *mtp[it]) for it, (lm, balancing, _) in balancing_logged(output).items()}


def test_mtp_losses_in_the_iteration_line_and_pipeline_parity(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    one = pretrain_in_ranks(TINY + MTP + ["--metrics-jsonl", str(jsonl)], 1)[0]
    ours = logged(one)
    assert sorted(ours) == [1, 2, 3, 4] and ours.keys() == losses(one).keys()
    for lm, mtp1, mtp2 in ours.values():
        assert all(math.isfinite(v) and 3.0 < v < 6.0 for v in (lm, mtp1, mtp2))
        assert mtp1 != lm and mtp2 != mtp1  # each depth's own loss, not the main one
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    iterations = {r["iteration"]: r for r in records if r["kind"] == "iteration"}
    assert sorted(iterations) == sorted(ours)
    for it, r in iterations.items():  # the line prints 7 digits
        assert abs(r["mtp_1 loss"] - ours[it][1]) < 1e-6 and abs(r["mtp_2 loss"] - ours[it][2]) < 1e-6
    layouts = (["--pipeline-model-parallel-size", "2"], ["--use-distributed-optimizer"],
               ["--use-torch-fsdp2"], ["--context-parallel-size", "2"])
    for layout in layouts:
        parallel = logged(pretrain_in_ranks(TINY + MTP + layout, 2)[-1])
        assert sorted(parallel) == sorted(ours), layout
        for it, values in parallel.items():
            assert max(abs(a - b) for a, b in zip(values, ours[it])) < 1e-5, (layout, it, values, ours[it])


def test_moe_mtp_layer_under_expert_and_pipeline_parallelism_logs_the_single_process_losses():
    """The MTP layer of an MoE model (its last layer MoE) is an MoE layer: EP 2 splits its experts,
    PP 2 puts it on the last stage; lm, balancing and MTP losses equal one process within 1e-5."""
    flags = TINY + MOE + MTP  # MTP's --train-iters 4 and --global-batch-size 2 come last and win
    one = moe_logged(pretrain_in_ranks(flags, 1)[0])
    assert sorted(one) == [1, 2, 3, 4] and all(values[1] > 0.5 for values in one.values())
    for layout in (["--expert-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]):
        parallel = moe_logged(pretrain_in_ranks(flags + layout, 2)[-1])
        assert sorted(parallel) == sorted(one), layout
        for it, values in parallel.items():
            assert max(abs(a - b) for a, b in zip(values, one[it])) < 1e-5, (layout, it, values, one[it])
