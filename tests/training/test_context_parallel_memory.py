"""Saved activations per rank under context parallelism: CP 1's bytes / cp, and the planner."""

import pytest

from benchmarks.bench_util import build_state, gpt_flags, repeat_batch, synthetic_batch
from benchmarks.memory import saved_bytes
from megafab.arguments import config_from_args
from megafab.plan.planner import plan
from megafab.run.fork_ranks import run_ranks

SEQ = 512


def _flags(cp, comm):
    return gpt_flags(2, 32, 4, SEQ, 1, 128) + ["--context-parallel-size", str(cp), "--cp-comm-type", comm]


def _saved(rank, world, flags):
    state = build_state(flags, world_size=world)
    return saved_bytes(state, repeat_batch(synthetic_batch(1, SEQ, 128)))


@pytest.mark.parametrize("comm", ["p2p", "allgather", "a2a"])
def test_saved_activations_per_rank_are_cp1_over_cp_and_planned(comm):
    single = run_ranks(_saved, 1, _flags(1, "p2p"), timeout=120)[0]
    per_rank = run_ranks(_saved, 2, _flags(2, comm), timeout=120)
    planned = plan(config_from_args(_flags(2, comm), world_size=2), kernels="flash")[0]
    for saved in per_rank:
        print(f"{comm}: CP1 {single} CP2 {saved} ({saved / (single / 2):.3f} x CP1/2), planned "
              f"{planned.activation_bytes_per_micro_batch}")
        assert abs(saved - single / 2) <= 0.15 * single / 2
        assert abs(planned.activation_bytes_per_micro_batch - saved) <= 0.15 * saved
    assert planned.kv_exchange_bytes > 0
