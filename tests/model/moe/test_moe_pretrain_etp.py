"""pretrain_gpt.py --mock-data, a tiny MoE model under attention TP 2 + SP on 2 ranks (ETP = TP = 2):
the logged lm loss and load_balancing_loss of each of 5 iterations equal one process's within 1e-5
(float32). DP is 1, so no expert gradient meets the DP reduction (expert-DP reductions are the DDP
helper's); the gradient norm (clipping) sees the ETP shards. (ETP 1 x EP 2 under the same TP 2 + SP
was measured equal too, 5e-6 at iteration 5; not kept: 40 s.)"""

from __future__ import annotations

import pytest

from tests.training.launch import pretrain_in_ranks
from tests.training.test_moe_pretrain_parity import MOE, _assert_parity, _logged
from tests.training.tiny_corpus import TINY

pytestmark = pytest.mark.slow  # ~35 s on a loaded 2-core machine (two short runs)
FLAGS = TINY + MOE + ["--disable-bias-linear"]  # megatron-core refuses expert biases at ETP > 1


def test_moe_under_tensor_and_expert_tensor_parallel_logs_the_single_process_losses():
    reference = _logged(pretrain_in_ranks(FLAGS, 1)[0])
    tp_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    ours = _logged(pretrain_in_ranks(FLAGS + tp_sp, 2)[-1])
    _assert_parity(ours, reference)
