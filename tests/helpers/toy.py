"""Toy models that carry Megatron's parameter attributes, for optimizer and DP tests.

ToyMLP: replicated params only (a stack of Linear + a LayerNorm), any dtype.
ToyTPBlock: LayerNorm (replicated, sequence_parallel) -> column-parallel fc1 -> GELU ->
row-parallel fc2 -> + bias (replicated, sequence_parallel), with sequence parallelism over a TP
group (input split along the sequence). With tp_group=None it is the single-process model; every
TP rank holds exactly the shards of the single-process weights made from the same seed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class ToyMLP(nn.Module):
    def __init__(self, hidden: int = 16, layers: int = 3, dtype=torch.float64, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.norm = nn.LayerNorm(hidden, dtype=dtype)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, dtype=dtype) for _ in range(layers))
        self.head = nn.Linear(hidden, 1, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)

    def forward(self, x):  # x [b, h] -> [b]
        x = self.norm(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).squeeze(-1)


def regression_batch(n: int, hidden: int, dtype=torch.float64, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    return x, y


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


class _GatherSeq(torch.autograd.Function):
    """all-gather along dim 0 forward, reduce-scatter backward (Megatron's SP 'g')."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), 0)[dist.get_rank(ctx.group)].contiguous(), None


class _ReduceScatterSeq(torch.autograd.Function):
    """reduce-scatter along dim 0 forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x.chunk(dist.get_world_size(group), 0)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, 0), None


class ToyTPBlock(nn.Module):
    """[s, b, h] -> [s/tp, b, h] with SP; the single-process model when tp_group is None."""

    def __init__(self, hidden: int = 8, tp_group=None, dtype=torch.float64, seed: int = 0):
        super().__init__()
        self.tp_group = tp_group
        tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        rank = 0 if tp_group is None else dist.get_rank(tp_group)
        gen = torch.Generator().manual_seed(seed)
        full = {"norm_w": 1 + 0.1 * torch.randn(hidden, generator=gen, dtype=torch.float64),
                "norm_b": 0.1 * torch.randn(hidden, generator=gen, dtype=torch.float64),
                "fc1_w": 0.4 * torch.randn(4 * hidden, hidden, generator=gen, dtype=torch.float64),
                "fc1_b": 0.1 * torch.randn(4 * hidden, generator=gen, dtype=torch.float64),
                "fc2_w": 0.3 * torch.randn(hidden, 4 * hidden, generator=gen, dtype=torch.float64),
                "fc2_b": 0.1 * torch.randn(hidden, generator=gen, dtype=torch.float64)}
        self.shard_of = {"fc1_w": 0, "fc1_b": 0, "fc2_w": 1}  # name -> partition_dim
        for name, value in full.items():
            dim = self.shard_of.get(name)
            if dim is not None:
                value = value.chunk(tp, dim)[rank]
            param = nn.Parameter(value.to(dtype).clone())
            if dim is not None:
                param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
            else:
                param.sequence_parallel = True
            setattr(self, name, param)

    def forward(self, x):  # x [s/tp, b, h]
        h = F.layer_norm(x, x.shape[-1:], self.norm_w, self.norm_b)
        if self.tp_group is not None:
            h = _GatherSeq.apply(h, self.tp_group)  # [s, b, h]
        a = F.gelu(h @ self.fc1_w.t() + self.fc1_b)  # [s, b, 4h/tp]
        o = a @ self.fc2_w.t()  # [s, b, h] partial sum over TP
        if self.tp_group is not None:
            o = _ReduceScatterSeq.apply(o, self.tp_group)  # [s/tp, b, h]
        return o + self.fc2_b


def shard_like(reference: torch.Tensor, param: nn.Parameter, tp: int, tp_rank: int) -> torch.Tensor:
    """The slice of a single-process tensor that a TP rank's param holds."""
    if not getattr(param, "tensor_model_parallel", False):
        return reference
    return reference.chunk(tp, param.partition_dim)[tp_rank]
