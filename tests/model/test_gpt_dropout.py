"""Dropout through the RNG tracker: reproducible, and per-TP-rank only where tensors are TP-split."""

import torch
import torch.distributed as dist

from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import batch, context, tiny_config


def _run(topo, cfg, sp, seed=1234):
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(seed, topo.tp_rank, topo.pp_rank, torch.device("cpu"), tracker)
    model = GPTModel(cfg, context(topo.group("tp"), sp, tracker=tracker))
    tokens, labels, mask = batch(cfg)
    loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    return loss.item(), model.embedding.word_embeddings.weight.grad.clone()


def _dropout_checks(rank, world):
    topo = build_topology(tp=world)
    cfg = tiny_config(tp=world, hidden_dropout=0.2, attention_dropout=0.2).model
    no_dropout = tiny_config(tp=world).model
    for sp in (False, True):
        first, second = _run(topo, cfg, sp), _run(topo, cfg, sp)
        assert first[0] == second[0] and torch.equal(first[1], second[1])  # bit-identical
        assert first[0] != _run(topo, no_dropout, sp)[0]  # dropout is active
        assert first[0] != _run(topo, cfg, sp, seed=4321)[0]  # and follows the seed
        # The loss is a TP-reduced quantity: every TP rank must agree on it, which fails if
        # ranks drew different masks on replicated (non-SP) residual tensors.
        losses = [None] * world
        dist.all_gather_object(losses, first[0], group=topo.group("tp"))
        assert max(losses) - min(losses) < 1e-12, losses

    # Inside a TP region masks differ per rank; on replicated tensors they agree.
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, topo.tp_rank, 0, torch.device("cpu"), tracker)
    ones = torch.ones(64, dtype=torch.float64)
    outside = torch.nn.functional.dropout(ones, 0.5)
    with tracker.fork():
        inside = torch.nn.functional.dropout(ones, 0.5)
    masks = [torch.empty(2, 64, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(masks, torch.stack([outside, inside]), group=topo.group("tp"))
    assert all(torch.equal(m[0], masks[0][0]) for m in masks)
    assert not torch.equal(masks[0][1], masks[1][1])
    return True


def test_dropout_is_reproducible_and_tp_aware():
    assert all(run_ranks(_dropout_checks, 2, timeout=120))
