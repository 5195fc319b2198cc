"""FSDP2 builds from the meta device: no rank ever holds more than one part (a layer, the
embedding, ...) of the model unsharded, and the shards equal the single-process model's values."""

from __future__ import annotations

import weakref

import torch

from benchmarks.bench_util import peak_cpu_bytes
from megafab.distributed.fsdp import local_tensor, shard_range
from megafab.model.gpt import GPTModel
from megafab.run.fork_ranks import run_ranks
from tests.helpers.driver import driver_state
from tests.helpers.tiny import reference_model, tiny_config


def _build_one_part_at_a_time(rank, world):
    cfg = tiny_config(num_layers=4, hidden_size=64, vocab_size=128, use_torch_fsdp2=True, dp=world,
                      global_batch_size=2 * world)
    live, most = weakref.WeakSet(), [0]
    build_part = GPTModel.build_part

    def counted(self, name, ctx):
        part = build_part(self, name, ctx)
        if ctx.device.type != "meta":
            live.add(part)
            most[0] = max(most[0], len(live))
        return part

    GPTModel.build_part = counted
    try:
        states = []
        peak = peak_cpu_bytes(lambda: states.append(driver_state(cfg, torch.float64)))
    finally:
        GPTModel.build_part = build_part
    chunk = states[0].model[0]
    reference = reference_model(cfg.model, seed=cfg.training.seed)
    full = dict(reference.named_parameters())
    parts = [sum(p.numel() for p in reference.get_submodule(n).parameters()) for n in reference.part_names()]
    held = 0
    for name, param in chunk.module.named_parameters():
        lo, hi = shard_range(param)
        # this rank's shard: exactly the single-process values of its rows, and only those
        assert torch.equal(local_tensor(param).reshape(-1), full[name].detach().reshape(-1)[lo:hi]), name
        assert hi - lo <= -(-param.shape[0] // world) * (param.numel() // param.shape[0]), name
        held += local_tensor(param).numel()
    return most[0], peak, held, max(parts), sum(p.numel() for p in full.values())


def test_fsdp2_build_holds_one_part_at_a_time():
    world = 2
    for most, peak, held, largest_part, total in run_ranks(_build_one_part_at_a_time, world, timeout=120):
        assert most == 1  # each part is freed before the next is built
        assert held <= total // world + 4096
        # the build's allocator peak: the shards, one part and its init scratch (the float64 full
        # weight drawn, its partition), below the whole model (measured: held + 1.35 parts)
        assert peak <= 8 * (held + 2 * largest_part), (peak, held, largest_part)
        assert peak < 8 * total, (peak, total)
