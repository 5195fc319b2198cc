"""Tensor-parallel linear and embedding layers (Megatron's ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding), taking their tensor-parallel group explicitly.

Initialization equals one process: every rank fills the FULL (unsharded) weight with `init_method`
and keeps its partition, so the shards of a TP=n model are exactly slices of the TP=1 weight built
from the same seed. The full weight is built on the CPU in float64 when params_dtype is float64 and
in float32 otherwise (then cast, as Megatron's CPU initialization does), and moved to `device`.
Building on the CPU makes the values independent of the device; the price is one full weight of
host memory per rank while a layer is built.

Layouts are torch's: weight [out, in]; Column keeps [out/tp, in] (partition_dim 0), Row keeps
[out, in/tp] (partition_dim 1), the embedding keeps [V/tp, h] (partition_dim 0): the dims of
megafab.param_names' TP-partition table, which checkpoint readers use for files that carry no
attributes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megafab.distributed.linear import linear_with_grad_accumulation_and_async_allreduce
from megafab.distributed.mappings import (
    ShardingError,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megafab.errors import MegafabError
from megafab.param_names import COLUMN_DIM, ROW_DIM, VOCAB_DIM

InitMethod = Callable[[torch.Tensor], object]


class ParallelLayerError(MegafabError):
    """A layer configuration that cannot be built; the message names the value and the fix."""


def default_init_method(tensor: torch.Tensor) -> None:
    """normal(0, 0.02) from torch's default (CPU) generator."""
    nn.init.normal_(tensor, mean=0.0, std=0.02)


def vocab_range(global_vocab: int, rank: int, world: int) -> tuple[int, int]:
    """[first, last) token ids held by `rank` of `world` TP ranks: [rank*V/tp, (rank+1)*V/tp)."""
    if global_vocab % world != 0:
        raise ParallelLayerError(
            f"vocabulary size {global_vocab} is not divisible by tensor-model-parallel size {world}; "
            f"pad the vocabulary to a multiple of {world} (Megatron pads to a multiple of "
            f"make-vocab-size-divisible-by x tensor-model-parallel-size)")
    per_rank = global_vocab // world
    return rank * per_rank, (rank + 1) * per_rank


def partition_of(full: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1) -> torch.Tensor:
    """The shard of `full` that TP rank `rank` keeps along `dim`.

    With stride > 1 (Megatron's partition_stride) `dim` is first cut into `stride` equal blocks,
    each block into `world` chunks, and the rank keeps chunk `rank` of every block, concatenated.
    For SwiGLU's packed fc1 [gate; up] with stride 2 this gives rank r [gate_r; up_r].
    """
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([block.chunk(world, dim=dim)[rank] for block in blocks], dim=dim).contiguous()


def join_partitions(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of partition_of: the full tensor from every rank's shard (in TP rank order)."""
    per_block = [part.chunk(stride, dim=dim) for part in parts]
    blocks = [torch.cat([p[b] for p in per_block], dim=dim) for b in range(stride)]
    return torch.cat(blocks, dim=dim)


def _check_divisible(value: int, what: str, world: int, stride: int = 1) -> None:
    if value % (world * stride) != 0:
        factor = f"tensor-model-parallel size {world}" + (f" x stride {stride}" if stride > 1 else "")
        raise ParallelLayerError(
            f"{what} is {value}, which is not divisible by {factor} = {world * stride}; "
            f"choose a size that is a multiple of {world * stride}")


def _master_dtype(params_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if params_dtype == torch.float64 else torch.float32


def _sharded_weight(shape: tuple[int, int], dim: int, stride: int, group, init_method: InitMethod | None,
                    params_dtype: torch.dtype, device) -> nn.Parameter:
    """Build the full weight with init_method, keep this rank's partition, mark the attributes."""
    master = torch.empty(shape, dtype=_master_dtype(params_dtype))
    with torch.no_grad():
        (init_method or default_init_method)(master)
    shard = partition_of(master, dim, group_rank(group), group_size(group), stride)
    weight = nn.Parameter(shard.to(device=device, dtype=params_dtype))
    weight.tensor_model_parallel = True
    weight.partition_dim = dim
    weight.partition_stride = stride
    return weight


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output dim: rank r computes Y's columns r.

    Input [s, b, in] (with sequence parallel [s/tp, b, in], gathered inside the linear core, which
    keeps only the sharded input for backward), output [s, b, out/tp], or [s, b, out] with
    gather_output. forward returns (output, bias) where bias is None unless skip_bias_add (then the
    caller adds it, e.g. fused into an activation). gradient_accumulation_fusion: add the weight
    gradient straight into `weight.main_grad` when DDP gave it one (megafab.distributed.linear).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None, stride: int = 1, skip_bias_add: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 gradient_accumulation_fusion: bool = True):
        super().__init__()
        world = group_size(tp_group)
        _check_divisible(output_size, "ColumnParallelLinear output size", world, stride)
        if gather_output and sequence_parallel:
            raise ParallelLayerError(
                "ColumnParallelLinear got gather_output=True with sequence_parallel=True; a gathered "
                "output would leave the sequence-parallel layout, so use one or the other")
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = output_size // world
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.weight = _sharded_weight((output_size, input_size), COLUMN_DIM, stride, tp_group, init_method,
                                      params_dtype, device)  # [out/tp, in]
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype,
                                                 device=device))
            self.bias.tensor_model_parallel = True
            self.bias.partition_dim = COLUMN_DIM
            self.bias.partition_stride = stride
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        tp = group_size(self.tp_group)
        output = linear_with_grad_accumulation_and_async_allreduce(  # [s(/tp), b, in] -> [s, b, out/tp]
            x, self.weight, bias, group=self.tp_group,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=tp > 1 and not self.sequence_parallel, sequence_parallel=self.sequence_parallel)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)  # [s, b, out]
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, "
                f"out_per_partition={self.output_size_per_partition}, bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input dim: rank r holds A's columns r, sums are reduced.

    Input [s, b, in/tp] (input_is_parallel) or [s, b, in] (split here), output [s, b, out], or
    [s/tp, b, out] with sequence parallel (reduce-scatter instead of all-reduce). The bias is
    replicated and added after the reduction; under sequence parallel its gradient is partial per
    rank, hence `bias.sequence_parallel`. forward returns (output, bias or None as in Column).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None, skip_bias_add: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 gradient_accumulation_fusion: bool = True):
        super().__init__()
        world = group_size(tp_group)
        _check_divisible(input_size, "RowParallelLinear input size", world)
        if sequence_parallel and not input_is_parallel:
            raise ParallelLayerError(
                "RowParallelLinear got sequence_parallel=True with input_is_parallel=False; sequence "
                "parallel needs the input already split along the hidden dim, so pass "
                "input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size // world
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.weight = _sharded_weight((output_size, input_size), ROW_DIM, 1, tp_group, init_method,
                                      params_dtype, device)  # [out, in/tp]
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)  # [s, b, in] -> [s, b, in/tp]
        fused_bias = group_size(self.tp_group) == 1 and not self.skip_bias_add  # nothing to reduce
        partial = linear_with_grad_accumulation_and_async_allreduce(  # [s, b, out], partial sums
            x, self.weight, self.bias if fused_bias else None, group=self.tp_group,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion)
        if fused_bias:
            return partial, None
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # [s/tp, b, out]
        else:
            output = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, "
                f"in_per_partition={self.input_size_per_partition}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


def _lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The rows of `ids`; under --deterministic-mode by indexing, as megatron-core does (CUDA's
    F.embedding backward adds its gradient rows in no fixed order)."""
    return weight[ids] if torch.are_deterministic_algorithms_enabled() else F.embedding(ids, weight)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: rank r holds rows vocab_range(V, r, tp).

    Ids of other ranks' rows look up row 0 and are zeroed, then the partial outputs are summed
    across the group: ids [b, s] -> [b, s, h], complete on every rank. With
    reduce_scatter_embeddings (sequence parallel, Megatron's option) the partial sums are instead
    transposed and reduce-scattered along the sequence: ids [b, s] -> [s/tp, b, h], so no rank
    ever holds the full [s, b, h] output.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group,
                 init_method: InitMethod | None = None, params_dtype: torch.dtype = torch.float32,
                 device=None, reduce_scatter_embeddings: bool = False):
        super().__init__()
        world, rank = group_size(tp_group), group_rank(tp_group)
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, rank, world)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = self.vocab_end - self.vocab_start
        self.tp_group = tp_group
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and world > 1
        self.weight = _sharded_weight((num_embeddings, embedding_dim), VOCAB_DIM, 1, tp_group, init_method,
                                      params_dtype, device)  # [V/tp, h]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return _lookup(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = _lookup(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            partial = partial.transpose(0, 1).contiguous()  # [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # [s/tp, b, h]
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"vocab_range=[{self.vocab_start}, {self.vocab_end})")


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLayerError",
           "ShardingError", "default_init_method", "join_partitions", "partition_of", "vocab_range"]
