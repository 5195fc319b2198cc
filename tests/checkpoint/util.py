"""Shared by the checkpoint tests: a float64 TrainState of any layout, a training loop whose
global samples do not depend on the DP size, and every tensor of a saved checkpoint."""

import torch

from megafab.checkpoint import dcp_io
from megafab.checkpoint.layout import Shard
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from megafab.training.step import train_step
from tests.model.tiny import GPT2_STYLE, batch, tiny_config

GLOBAL_BATCH = 4


def make_state(tp, dp, dist_opt, style=GPT2_STYLE, dtype=torch.float64, save=None, load=None, **overrides):
    flat = dict(tp=tp, style=style, dp=dp, vocab_size=101, make_vocab_size_divisible_by=8,
                micro_batch_size=1, global_batch_size=GLOBAL_BATCH, use_distributed_optimizer=dist_opt,
                ddp_bucket_size=700, lr=1e-2, train_iters=10, bf16=dtype == torch.bfloat16, save=save,
                load=load)
    cfg = tiny_config(**{**flat, **overrides})
    topo = build_topology(tp=tp)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker, dtype=dtype)
    optimizer = build_optimizer(cfg, topo, model)
    return TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))


def train(state, steps: int) -> list[float]:
    """Global sample g of step s is batch(seed=1000 s + g) whatever the DP size."""
    m = state.cfg.training.num_micro_batches
    losses = []
    for _ in range(steps):
        s = state.iteration
        mbs = []
        for k in range(m):
            tokens, labels, mask = batch(state.cfg.model, 1, seed=1000 * s + state.topology.dp_rank * m + k)
            mbs.append({"tokens": tokens, "labels": labels, "loss_mask": mask})
        losses.append(train_step(state, iter(mbs))["lm loss"])
    return losses


def read_everything(path):
    metadata = dcp_io.read_metadata(path).state_dict_metadata
    shards = {k: Shard.whole(torch.empty(tuple(md.size), dtype=md.properties.dtype))
              for k, md in metadata.items()}
    dcp_io.load_shards(shards, path)
    return {k: s.views[0] for k, s in shards.items()}
