"""Key/value cache for generation: each layer's keys and values of the positions seen so far, in a
buffer preallocated for the whole generation, so a new token costs one position (no recompute of
the prefix, no re-copy of the cache)."""

from __future__ import annotations

import torch


class LayerKVCache:
    """One layer's keys/values [b, groups, capacity, d]; `update` appends and returns the filled part."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.keys = self.values = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [b, groups, s_new, d] -> all cached keys/values [b, groups, length + s_new, d]."""
        if self.keys is None:
            b, g, _, d = k.shape
            self.keys = k.new_empty(b, g, self.capacity, d)
            self.values = v.new_empty(b, g, self.capacity, v.shape[-1])  # MLA: v's width is its own
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions but generation reached {end}; "
                             f"create the cache with the prompt length + max new tokens")
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """The cache of a whole model chunk, keyed by global layer number (GPTModel's `kv_cache`)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.layers: dict[int, LayerKVCache] = {}

    def layer(self, number: int) -> LayerKVCache:
        if number not in self.layers:
            self.layers[number] = LayerKVCache(self.capacity)
        return self.layers[number]

    @property
    def length(self) -> int:
        """Positions cached so far."""
        return next(iter(self.layers.values())).length if self.layers else 0


def causal_mask(new: int, total: int, device=None) -> torch.Tensor:
    """Megatron-style mask [1, 1, new, total], True where attention is NOT allowed: the `new`
    queries are the last positions of `total`, each sees itself and everything before it."""
    return torch.ones(new, total, dtype=torch.bool, device=device).triu(total - new + 1)[None, None]
