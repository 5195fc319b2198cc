"""The multi-rank launcher of the tests is the run layer's (benchmarks use it too)."""

from megafab.run.fork_ranks import RankFailure, RankTimeout, run_ranks  # noqa: F401
