"""--deterministic-mode as Megatron-LM HEAD applies it (megatron/training/determinism.py): the ranks
run with torch's deterministic algorithms and Megatron's environment defaults (a value set by the
launcher is kept when it is deterministic, refused by name when not), the embedding gathers its rows
by indexing (the same values), two runs give the same losses bit for bit; the fused cross entropy is
refused with it, as Megatron does."""

from __future__ import annotations

import os

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from megafab.distributed.layers import _lookup
from megafab.run import determinism
from tests.helpers.launch import losses
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, assert_one_message, write_corpus

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="these tests fork their ranks")


def _report_state(rank: int) -> None:
    """before_main: after the run, print what deterministic mode set in this rank."""
    import atexit

    def report():
        print(f"STATE deterministic={torch.are_deterministic_algorithms_enabled()} "
              f"nccl={os.environ.get('NCCL_ALGO')} cublas={os.environ.get('CUBLAS_WORKSPACE_CONFIG')} "
              f"nvte={os.environ.get('NVTE_ALLOW_NONDETERMINISTIC_ALGO')}", flush=True)
    atexit.register(report)
    from megafab.training import pretrain

    run = pretrain.pretrain

    def run_then_report(cfg):
        try:
            return run(cfg)
        finally:
            report()
    pretrain.pretrain = run_then_report


def test_two_deterministic_runs_equal_and_set_megatrons_state(tmp_path):
    corpus = write_corpus(str(tmp_path / "good"))
    flags = TINY + ["--train-iters", "3", "--data-path", corpus, "--split", "90,5,5", "--global-batch-size",
                    "4", "--tensor-model-parallel-size", "2", "--deterministic-mode"]
    env = {"NCCL_ALGO": "CollnetDirect,^NVLS"}  # a launcher's own deterministic choice is kept
    first = run_ranks_main(2, flags, tmp_path / "a", env=env, before_main=_report_state)
    second = run_ranks_main(2, flags, tmp_path / "b", env=env, before_main=_report_state)
    assert first.codes == second.codes == [0, 0], first.describe()
    out = "".join(first.out)
    assert "STATE deterministic=True nccl=CollnetDirect,^NVLS cublas=:4096:8 nvte=0" in out, out[-2000:]
    assert sorted(losses(out)) == [1, 2, 3] and losses(out) == losses("".join(second.out))


def test_a_nondeterministic_environment_is_refused_by_name(tmp_path):
    flags = TINY + ["--train-iters", "1", "--mock-data", "--deterministic-mode"]
    result = run_ranks_main(1, flags, tmp_path, env={"NCCL_ALGO": "Tree", "CUBLAS_WORKSPACE_CONFIG": ":0:0"})
    line = assert_one_message(result, r"--deterministic-mode with NCCL_ALGO='Tree'")
    assert "Ring" in line
    assert "CUBLAS_WORKSPACE_CONFIG=':0:0'" in "".join(result.err)


def test_env_problems_and_defaults():
    assert determinism.env_problems({}) == []
    fine = {"NCCL_ALGO": "Ring,CollnetChain", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    assert determinism.env_problems(fine) == []
    bad = determinism.env_problems({"NCCL_ALGO": "", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1",
                                    "MAMBA_DETERMINISTIC": "0"})
    assert [line.split(" with ")[1].split("=")[0] for line in bad] == \
        ["NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "MAMBA_DETERMINISTIC"]


def test_the_fused_cross_entropy_is_refused_with_it():
    with pytest.raises(ConfigError) as info:
        config_from_args(TINY + ["--train-iters", "1", "--mock-data", "--deterministic-mode",
                                 "--cross-entropy-loss-fusion"], world_size=1)
    assert any("drop --cross-entropy-loss-fusion" in p for p in info.value.problems)


def test_the_indexed_lookup_equals_the_embedding_in_value_and_gradient():
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 3, 3], [10, 0, 1]])
    plain = _lookup(ids, weight)
    plain.sum().backward()
    grad = weight.grad.clone()
    weight.grad = None
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        indexed = _lookup(ids, weight)
        indexed.sum().backward()
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(plain, indexed) and torch.equal(grad, weight.grad)
