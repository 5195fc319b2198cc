"""The tiny MoE pretrain runs' flags and how their logged losses are read and compared (the MoE
pretrain parity tests of tests/training and tests/model/moe)."""

from __future__ import annotations

import re

from tests.helpers.launch import losses

MOE = ["--mock-data", "--train-iters", "5", "--global-batch-size", "4", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-layer-freq", "([0]*1+[1]*1)", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
       "--moe-shared-expert-intermediate-size", "24", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.5", "--disable-bias-linear"]
# (the bias rate moves the step-2 lm loss by 2e-3: the bias update over the ranks is checked too)
BALANCING = re.compile(r"iteration\s+(\d+)/.*? load_balancing_loss: (\S+) \| z_loss: (\S+) \|")


def logged(output: str) -> dict[int, tuple[float, float, float]]:
    """Per iteration: (lm loss, load_balancing_loss, z_loss) of a run's log."""
    lm = losses(output)
    return {int(m.group(1)): (lm[int(m.group(1))], float(m.group(2)), float(m.group(3)))
            for m in BALANCING.finditer(output)}


def assert_parity(ours, reference):
    assert sorted(ours) == sorted(reference) == [1, 2, 3, 4, 5]
    for it, (lm, balancing, z) in ours.items():
        ref_lm, ref_balancing, _ = reference[it]
        assert abs(lm - ref_lm) < 1e-5, (it, ours[it], reference[it])
        assert abs(balancing - ref_balancing) < 1e-5, (it, ours[it], reference[it])
        assert balancing > 0.5 and z > 0  # logged, not zeros
