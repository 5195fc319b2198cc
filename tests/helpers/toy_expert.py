"""A toy mixture of experts for the expert-data-parallel tests (no dependence on megafab's MoE).

    x [b, h] -> tanh(dense) -> router (top-1 by argmax, weighted by its softmax probability)
             -> routed experts (Linear -> tanh -> Linear, `is_expert`) -> + residual -> head [b]

With an EP group the tokens are all-gathered over it, each EP rank applies its `num_experts / ep`
local experts to the tokens routed to them, and the partial outputs are reduce-scattered back
(megatron-core's allgather dispatcher), so an expert's gradient gathers the contributions of every
rank of its EP group. Expert e's weights are drawn from (seed, e) whatever rank holds it, so the
model with ep_group=None (every expert local) is the one-process reference of any EP layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megafab.distributed.mappings import (
    gather_first_dim,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def _filled(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    return module


class ToyMoE(nn.Module):
    def __init__(self, hidden: int = 6, num_experts: int = 4, ep_group=None, dtype=torch.float64,
                 seed: int = 0):
        super().__init__()
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.ep_group = ep_group
        self.num_experts = num_experts
        self.num_local = num_experts // ep
        self.first_expert = ep_rank * self.num_local
        self.dense = _filled(nn.Linear(hidden, hidden, dtype=dtype), seed)
        self.router = _filled(nn.Linear(hidden, num_experts, bias=False, dtype=dtype), seed + 1)
        self.experts = nn.ModuleList(
            _filled(nn.Sequential(nn.Linear(hidden, 2 * hidden, dtype=dtype), nn.Tanh(),
                                  nn.Linear(2 * hidden, hidden, dtype=dtype)), 1000 * (seed + 1) + e)
            for e in range(self.first_expert, self.first_expert + self.num_local))
        for p in self.experts.parameters():
            p.is_expert = True
        self.head = _filled(nn.Linear(hidden, 1, dtype=dtype), seed + 2)

    def global_expert_name(self, name: str) -> str:
        """'experts.{local}.rest' -> 'experts.{global}.rest' (the reference model's name)."""
        if not name.startswith("experts."):
            return name
        _, local, rest = name.split(".", 2)
        return f"experts.{self.first_expert + int(local)}.{rest}"

    def forward(self, x):  # x [b, h] -> [b]
        h = torch.tanh(self.dense(x))
        logits = self.router(h)  # [b, E]
        probs = F.softmax(logits, dim=-1)
        route = logits.argmax(dim=-1)
        if self.ep_group is not None:
            route = gather_first_dim(route, self.ep_group)
            h_all = gather_from_sequence_parallel_region(h, self.ep_group)  # [b * ep, h]
            probs = gather_from_sequence_parallel_region(probs, self.ep_group)
        else:
            h_all = h
        out = torch.zeros_like(h_all)
        for i, expert in enumerate(self.experts):
            e = self.first_expert + i
            weight = probs[:, e] * (route == e).to(probs.dtype)  # [b * ep]
            out = out + expert(h_all) * weight.unsqueeze(-1)
        if self.ep_group is not None:
            out = reduce_scatter_to_sequence_parallel_region(out, self.ep_group)  # [b, h]
        return self.head(h + out).squeeze(-1)
