"""pretrain_gpt.py --mock-data with --mtp-num-layers (float32, 4 iterations): the iteration line
carries each depth's MTP loss after the lm loss under Megatron's names (`mtp_1 loss: ... |`,
MTPLossLoggingHelper's), metrics.jsonl too, and PP 2 (MTP on the last stage, its embedding copy's
gradient summed with the first stage's), DP 2 with the distributed optimizer and DP 2 with FSDP2 log
the lm and MTP losses of one process within 1e-5."""

from __future__ import annotations

import json
import math
import re

from tests.helpers.launch import losses, pretrain_in_ranks
from tests.helpers.tiny_corpus import TINY

MTP = ["--mock-data", "--train-iters", "4", "--global-batch-size", "2", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--position-embedding-type", "rope", "--mtp-num-layers", "2",
       "--mtp-loss-scaling-factor", "0.5"]
LINE = re.compile(r"iteration\s+(\d+)/.*? lm loss: (\S+) \| mtp_1 loss: (\S+) \| mtp_2 loss: (\S+) \| "
                  r"loss scale")


def logged(output: str) -> dict[int, tuple[float, float, float]]:
    return {int(m.group(1)): tuple(float(v) for v in m.groups()[1:]) for m in LINE.finditer(output)}


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
               ["--use-torch-fsdp2"])
    for layout in layouts:
        parallel = logged(pretrain_in_ranks(TINY + MTP + layout, 2)[-1])
        assert sorted(parallel) == sorted(ours), layout
        for it, values in parallel.items():
            assert max(abs(a - b) for a, b in zip(values, ours[it])) < 1e-5, (layout, it, values, ours[it])
