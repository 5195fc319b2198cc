"""--check-weight-hash-across-dp-replicas-interval (Megatron's): at the start and every N iterations the
replicas' weights are compared by hash; equal replicas print Megatron's line and train on, a replica
whose weights drifted stops the job with one message naming the parameter and the ranks (exit 3,
every rank), and the fully sharded engines, whose ranks hold no replicas, are refused by name."""

from __future__ import annotations

import pytest

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, assert_one_message, write_corpus

CHECK = ["--check-weight-hash-across-dp-replicas-interval", "2"]


def _flags(tmp_path, *extra):
    corpus = write_corpus(str(tmp_path / "corpus"))
    return TINY + ["--train-iters", "4", "--data-path", corpus, "--split", "90,5,5", "--global-batch-size",
                   "2", *CHECK, *extra]

DIST_OPT = ["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce"]


def test_equal_replicas_pass_at_the_start_and_every_interval(tmp_path):
    result = run_ranks_main(2, _flags(tmp_path, *DIST_OPT), tmp_path / "log", timeout=120)
    assert result.codes == [0, 0], result.describe()
    lines = [line for line in result.out[0].splitlines() if line.startswith(">>> Weight hashes match")]
    assert lines == [f">>> Weight hashes match after {i} iterations..." for i in (0, 2, 4)]


def _drift_on_rank_1(rank):
    """Rank 1 nudges one weight after its second step: its replica no longer equals rank 0's (plain DDP:
    each rank steps its own copy, so the nudge stays)."""
    if rank != 1:
        return
    import torch

    from megafab.training import pretrain

    step = pretrain.train_step

    def drifting(state, *args, **kwargs):
        out = step(state, *args, **kwargs)
        if state.iteration == 2:
            with torch.no_grad():
                state.model[0].module.decoder.final_layernorm.weight.add_(1e-3)
        return out

    pretrain.train_step = drifting


def test_a_drifted_replica_stops_the_job_naming_the_parameter(tmp_path):
    result = run_ranks_main(2, _flags(tmp_path), tmp_path / "log", timeout=120, before_main=_drift_on_rank_1)
    message = assert_one_message(result, r"the weights of data-parallel replicas differ after iteration 2",
                                 code=3)
    assert "decoder.final_layernorm.weight (ranks 0 and 1);" in message
    assert "resume from the last checkpoint" in message


@pytest.mark.parametrize("extra,message", [
    (["--check-weight-hash-across-dp-replicas-interval", "0"], "must be positive"),
    (CHECK + ["--use-torch-fsdp2"], "the parameters are sharded across data-parallel ranks, not replicated"),
])
def test_rules(extra, message):
    flags = TINY + ["--train-iters", "4", "--mock-data", *extra]
    with pytest.raises(ConfigError, match=message):
        config_from_args(flags, world_size=2)
