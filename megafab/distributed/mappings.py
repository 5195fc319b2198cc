"""Paired autograd collectives for tensor, sequence and expert parallelism.

Each public function applies one collective forward and its adjoint backward, over the group it is
given; with `group=None` or a one-rank group it returns its input unchanged, so single-process code
runs the same layers. Megatron-LM's names (f, g: Shoeybi et al. 2019; SP's: Korthikanti et al. 2022):

    f      copy_to_tensor_model_parallel_region        fwd identity        bwd all-reduce
    g      reduce_from_tensor_model_parallel_region    fwd all-reduce      bwd identity
    g      gather_from_sequence_parallel_region        fwd all-gather      bwd reduce-scatter
    g-bar  reduce_scatter_to_sequence_parallel_region  fwd reduce-scatter  bwd all-gather
           all_to_all (MoE token dispatchers)          fwd all-to-all      bwd all-to-all reversed

Tensors are [s, b, h]: the tensor-parallel split is along the last dim, the sequence-parallel split
along dim 0. Collectives run on contiguous tensors and never write into the caller's tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megafab.distributed.sized_group import SizedGroup
from megafab.errors import MegafabError

# torch renamed the single-tensor collectives; the old names still work but warn.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ShardingError(MegafabError):
    """A tensor that cannot be split evenly over the parallel group."""


def group_size(group) -> int:
    """Ranks in `group`; None means no parallelism (1); a SizedGroup (building without groups) its size."""
    if group is None:
        return 1
    return group.size if isinstance(group, SizedGroup) else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside `group`; 0 when group is None."""
    if group is None:
        return 0
    return group.rank if isinstance(group, SizedGroup) else dist.get_rank(group)


def _check_divisible(size: int, world: int, what: str) -> None:
    if size % world != 0:
        raise ShardingError(
            f"{what} is {size}, which does not split evenly over {world} tensor-parallel ranks; "
            f"make it a multiple of {world} (or change the tensor-model-parallel size)")


# --- raw collectives (no autograd) -----------------------------------------------------------

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    _check_divisible(x.shape[-1], world, "the last (hidden) dimension")
    return x.chunk(world, dim=-1)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    # gloo accepts only the concatenated output layout, so gather along dim 0 and reorder.
    stacked = gather_first_dim(x.reshape(1, *x.shape), group)  # [tp, ..., h/tp]
    return torch.cat(stacked.unbind(0), dim=-1)


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    _check_divisible(x.shape[0], world, "the sequence length (dim 0)")
    # A dim-0 chunk is a view; copy it so the full [s, b, h] storage is not kept alive by it.
    return x.chunk(world, dim=0)[group_rank(group)].clone()


def gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x.contiguous(), group=group)
    return out


def gather_first_dim_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """All-gather along dim 0 where rank r holds sizes[r] rows (gloo's all-gather takes equal
    sizes only, so every rank sends its rows to each rank with one uneven all-to-all)."""
    world = group_size(group)
    send = x.contiguous().expand(world, *x.shape).reshape(world * x.shape[0], *x.shape[1:])
    return _exchange(send, sizes, [x.shape[0]] * world, group)


def reduce_scatter_first_dim_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Sum over the ranks of dim-0 chunks of `sizes`, rank r keeping chunk r."""
    x = x.contiguous()
    out = torch.empty((sizes[group_rank(group)], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter(out, list(x.split(sizes)), group=group)
    return out


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Send input_splits[r] rows of x to rank r, receive output_splits[r] rows from it."""
    out = torch.empty((sum(output_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    _check_divisible(x.shape[0], world, "the sequence length (dim 0)")
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


# --- autograd pairs --------------------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_first_dim(grad, ctx.group), None


def _gather_rows(x: torch.Tensor, sizes: list[int] | None, group) -> torch.Tensor:
    return gather_first_dim(x, group) if sizes is None else gather_first_dim_uneven(x, sizes, group)


def _reduce_scatter_rows(x: torch.Tensor, sizes: list[int] | None, group) -> torch.Tensor:
    if sizes is None:
        return reduce_scatter_first_dim(x, group)
    return reduce_scatter_first_dim_uneven(x, sizes, group)


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad, sizes):
        ctx.group, ctx.sizes = group, sizes
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_rows(grad, ctx.sizes, ctx.group), None, None, None
        if ctx.sizes is not None:
            rank = group_rank(ctx.group)
            start = sum(ctx.sizes[:rank])
            return grad[start:start + ctx.sizes[rank]].clone(), None, None, None
        return _split_first_dim(grad, ctx.group), None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.sizes, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


# --- public API ------------------------------------------------------------------------------

def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient backward.

    Placed before a ColumnParallelLinear: each rank consumes the full input, so the input's
    gradient is the sum of the ranks' partial gradients.
    """
    if group_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's g: all-reduce (sum) forward, identity backward.

    Placed after a RowParallelLinear or VocabParallelEmbedding, whose ranks hold partial sums.
    """
    if group_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's chunk of the last dim forward; all-gather the gradient's last dim backward.

    [..., h] -> [..., h/tp]. No paper name; used for a RowParallelLinear whose input is not split.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather the last dim forward (rank order); keep this rank's gradient chunk backward.

    [..., h/tp] -> [..., h]. No paper name; used for ColumnParallelLinear(gather_output=True).
    """
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's chunk of dim 0 forward; all-gather the gradient along dim 0 backward.

    [s, b, h] -> [s/tp, b, h]. No paper name; enters the SP region after the embedding.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, tensor_parallel_output_grad: bool = True,
                                         output_split_sizes: list[int] | None = None) -> torch.Tensor:
    """SP paper's g: all-gather along dim 0 forward, reduce-scatter backward.

    [s/tp, b, h] -> [s, b, h]. Backward reduce-scatters the gradient along dim 0, because the
    consumer (a ColumnParallelLinear) leaves each rank a partial gradient of the full sequence.
    With tensor_parallel_output_grad=False the consumer's gradient is already complete and
    identical on every rank, so backward only keeps this rank's chunk. output_split_sizes[r]: the
    rows of rank r when they differ (None: every rank holds x.shape[0]), as the MoE dispatchers
    need: every rank holds however many rows its router sent.

    Neither paper names an f-bar: with SP the f before a column-parallel block becomes this g, and
    the g after a row-parallel block becomes g-bar.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad, output_split_sizes)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group,
                                               input_split_sizes: list[int] | None = None) -> torch.Tensor:
    """SP paper's g-bar: reduce-scatter (sum) along dim 0 forward; all-gather dim 0 backward.

    [s, b, h] partial sums -> [s/tp, b, h] complete. Placed after a RowParallelLinear with SP.
    input_split_sizes[r]: the rows rank r keeps when they differ (None: equal chunks).
    """
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group, input_split_sizes)


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Expert parallelism's exchange: x [sum(input_splits), ...] -> [sum(output_splits), ...],
    input_splits[r] rows sent to rank r, output_splits[r] received from it; backward sends the
    gradient back the same way reversed."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)
