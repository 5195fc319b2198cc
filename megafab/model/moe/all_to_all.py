"""The expert-parallel all-to-all with uneven splits, as a paired autograd collective.

Forward sends input_splits[r] rows to rank r and receives output_splits[r] rows from it; backward
sends the gradient back the same way reversed. With group None or one rank it is the identity.
(It belongs beside the other pairs in megafab.distributed.mappings once that file takes it.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megafab.distributed.mappings import group_size


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = torch.empty((sum(output_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """x [sum(input_splits), ...] -> [sum(output_splits), ...] over `group`."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)
