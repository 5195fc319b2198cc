"""No rank allocates the DP-unsharded optimizer state to save or load a distributed-optimizer
checkpoint (DP 4, fp32, buckets smaller than the matrices). Assembling full blocks (the old path)
allocated all of it on every rank; here the allocator peak of save_checkpoint stays below a
quarter of it, and load_checkpoint allocates the rank's own new Adam state (a quarter) plus less
than another quarter (the DP all-gather of the weights, one chunk read at a time)."""

import torch

from benchmarks.bench_util import peak_cpu_bytes
from megafab.checkpoint import checkpointing
from megafab.checkpoint.state import named_parameters
from megafab.optim.memory import measure_memory
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import make_state, train

SIZES = dict(hidden_size=128, num_layers=2, ffn_hidden_size=512, ddp_bucket_size=20000)


def _peaks(rank, world, path):
    state = make_state(tp=1, dp=4, dist_opt=True, dtype=torch.float32, save=path, **SIZES)
    train(state, 1)  # the Adam state exists from here on
    numel = sum(p.numel() for _, p in named_parameters(state))
    unsharded = 2 * 4 * numel  # exp_avg + exp_avg_sq of every parameter (fp32 mains are the weights)
    save_peak = peak_cpu_bytes(lambda: checkpointing.save_checkpoint(state))
    fresh = make_state(tp=1, dp=4, dist_opt=True, dtype=torch.float32, load=path, **SIZES)
    load_peak = peak_cpu_bytes(lambda: checkpointing.load_checkpoint(fresh))
    own = measure_memory(fresh.model, fresh.optimizer).optimizer_bytes
    same = all(torch.equal(a, b) for a, b in zip(state.model[0].parameters(), fresh.model[0].parameters()))
    return unsharded, save_peak, load_peak, own, same


def test_save_and_load_never_hold_the_unsharded_optimizermake_state(tmp_path):
    for unsharded, save_peak, load_peak, own, same in run_ranks(_peaks, 4, str(tmp_path), timeout=240):
        assert same
        assert own <= unsharded / 4 + 4096, (own, unsharded)  # this rank's quarter (+ step tensors)
        assert save_peak < unsharded / 4, (save_peak, unsharded)
        assert load_peak < own + unsharded / 4, (load_peak, own, unsharded)
