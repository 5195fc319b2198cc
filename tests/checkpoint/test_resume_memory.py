"""A state dropped before a resume is freed: nothing it built (hooks in the parameters' C++
autograd metadata, optimizer, FSDP2 state) keeps the model alive, so a run that saves, drops its
state and loads the checkpoint into a fresh one (benchmarks/memory.py --peaks) holds one model,
not two. DP 2, after a step and a save, for the plain optimizer, the distributed optimizer and
FSDP2."""

import gc
import weakref

from megafab.checkpoint import checkpointing
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import make_state, train

ENGINES = {"ddp": dict(dist_opt=False), "dist-opt": dict(dist_opt=True),
           "fsdp2": dict(dist_opt=False, use_torch_fsdp2=True, ddp_bucket_size=None)}


def _freed(rank, world, path):
    freed = {}
    for engine, flags in ENGINES.items():
        state = make_state(tp=1, dp=2, save=f"{path}/{engine}", **flags)
        train(state, 1)
        checkpointing.save_checkpoint(state)
        refs = [weakref.ref(state.model[0]), weakref.ref(state.optimizer),
                weakref.ref(next(state.model[0].parameters()))]
        del state
        gc.collect()
        freed[engine] = [r() is None for r in refs]
    return freed


def test_a_dropped_state_is_freed(tmp_path):
    expected = {engine: [True] * 3 for engine in ENGINES}
    assert run_ranks(_freed, 2, str(tmp_path), timeout=120) == [expected] * 2
