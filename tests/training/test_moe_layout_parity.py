"""pretrain_gpt.py --mock-data with a tiny MoE model (float32, 5 iterations) under every expert
layout issue 23 names: each logs the lm loss, load_balancing_loss and grad norm of one process
with the same flags within 1e-5. Every layer is an MoE layer, so each pipeline stage routes.

The single-process reference is run once per routing variant (plain, capacity dropping, expert
bias) and shared by the layouts of that variant."""

from __future__ import annotations

import re

import pytest

from tests.helpers.launch import losses, pretrain_in_ranks
from tests.helpers.tiny_corpus import TINY

MOE = ["--mock-data", "--train-iters", "5", "--global-batch-size", "4", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-layer-freq", "1", "--moe-aux-loss-coeff", "1e-2", "--moe-shared-expert-intermediate-size", "24"]
VARIANTS = {
    "plain": [],
    # Capacity 1.0 of 4 experts top-2 over 16 tokens: 8 slots an expert, so some tokens drop.
    "capacity": ["--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "probs",
                 "--moe-token-dispatcher-type", "alltoall"],
    # Aux-loss-free balancing: the bias follows the tokens per expert after each step (a large
    # rate so that it changes routing within the 5 steps).
    "expert_bias": ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
                    "--moe-router-bias-update-rate", "1e-1"],
    "sigmoid": ["--moe-router-score-function", "sigmoid"],
}
# A variant's control: the same flags without what the variant adds, so the variant must change
# the losses (tokens really drop; the bias really moves after step 1).
CONTROL = {"capacity": "plain", "expert_bias": "sigmoid"}
EP2 = ["--expert-model-parallel-size", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# case -> (variant, world size, layout flags)
LAYOUTS = {
    "ep4-allgather": ("plain", 4, ["--expert-model-parallel-size", "4"]),
    "ep4-alltoall": ("plain", 4, ["--expert-model-parallel-size", "4",
                                  "--moe-token-dispatcher-type", "alltoall"]),
    "ep2-tp2-sp-etp1": ("plain", 4, EP2 + TP2_SP + ["--expert-tensor-parallel-size", "1"]),
    "ep2-tp2-sp-etp2": ("plain", 4, EP2 + TP2_SP + ["--expert-tensor-parallel-size", "2"]),
    "ep2-pp2": ("plain", 4, EP2 + PP2),
    "ep2-tp2-pp2": ("plain", 8, EP2 + TP2_SP + PP2),
    "ep2-dp2-distopt": ("plain", 4, EP2 + ["--use-distributed-optimizer"]),
    "ep2-cp2": ("plain", 4, EP2 + ["--context-parallel-size", "2"]),
    "ep2-fsdp2": ("plain", 4, EP2 + ["--use-torch-fsdp2"]),
    "ep2-capacity": ("capacity", 2, EP2),
    "ep2-expert-bias": ("expert_bias", 2, EP2),
}
BALANCING = re.compile(r"iteration\s+(\d+)/.*? load_balancing_loss: (\S+) \|")
GRAD_NORM = re.compile(r"iteration\s+(\d+)/.*? grad norm: (\S+) \|")
pytestmark = pytest.mark.slow  # 8-36 s a case on a loaded 2-core machine (3.5 min for all 11)


def _logged(output: str) -> dict[int, tuple[float, float, float]]:
    lm = losses(output)
    norm = {int(m.group(1)): float(m.group(2)) for m in GRAD_NORM.finditer(output)}
    return {int(m.group(1)): (lm[int(m.group(1))], float(m.group(2)), norm[int(m.group(1))])
            for m in BALANCING.finditer(output)}


@pytest.fixture(scope="module")
def single_process():
    """variant -> the one-process log, run on first use."""
    runs: dict[str, dict] = {}

    def get(variant: str) -> dict:
        if variant not in runs:
            runs[variant] = _logged(pretrain_in_ranks(TINY + MOE + VARIANTS[variant], 1)[0])
        return runs[variant]
    return get


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_moe_layout_logs_the_single_process_losses(case, single_process):
    variant, world, layout = LAYOUTS[case]
    reference = single_process(variant)
    ours = _logged(pretrain_in_ranks(TINY + MOE + VARIANTS[variant] + layout, world)[-1])
    assert sorted(ours) == sorted(reference) == [1, 2, 3, 4, 5]
    for it, (lm, balancing, norm) in ours.items():
        ref_lm, ref_balancing, ref_norm = reference[it]
        assert abs(lm - ref_lm) < 1e-5, (case, it, ours[it], reference[it])
        assert abs(balancing - ref_balancing) < 1e-5, (case, it, ours[it], reference[it])
        assert abs(norm - ref_norm) < 1e-5 * max(1.0, ref_norm), (case, it, ours[it], reference[it])
        assert balancing > 0.5 and norm > 0  # logged, not zeros
    if variant in CONTROL:
        control = single_process(CONTROL[variant])
        assert any(abs(reference[it][0] - control[it][0]) > 1e-4 for it in (2, 3, 4, 5)), (reference, control)
