"""Initialization keyed by parameter name, so every layout holds slices of the same weights.

Each weight's full tensor is drawn from its own generator, seeded from (seed, global parameter
name). A pipeline stage therefore initializes its layers exactly as the single-process model does,
without drawing the other stages' weights first, and TP layers keep slices of the same full
tensor. The tied output weight on the last stage takes the word embedding's name, so the two
copies start equal with no communication.

A model built on the meta device (FSDP2) draws nothing here: megafab.distributed.fsdp rebuilds it
one part (a layer) at a time on the device with these same init methods and keeps each rank's shard.
"""

from __future__ import annotations

import math
import zlib

import torch


def name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def normal_init(seed: int, name: str, std: float):
    """An init_method filling a full tensor with normal(0, std) from the (seed, name) stream."""

    def init(tensor: torch.Tensor) -> None:
        if tensor.is_meta:  # a model built on the meta device has no values yet (FSDP2 fills them)
            return
        gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
        with torch.no_grad():
            values = torch.empty(tensor.shape, dtype=torch.float64).normal_(0.0, std, generator=gen)
            tensor.copy_(values)

    return init


def output_layer_std(init_method_std: float, num_layers: int) -> float:
    """Megatron scales each layer's output projections by 1/sqrt(2 * num_layers)."""
    return init_method_std / math.sqrt(2.0 * num_layers)
