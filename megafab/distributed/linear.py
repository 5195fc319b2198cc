"""The one tensor-parallel linear autograd core: Megatron's
LinearWithGradAccumulationAndAsyncCommunication, used by ColumnParallelLinear, RowParallelLinear
and the GPT output layer.

Under sequence parallelism it saves the input as given (sharded [s/tp, b, in]) and all-gathers it
again in backward, which is what makes activation memory shrink by TP in the norm/dropout region
(Korthikanti et al. 2022, sec. 4.2.2). The backward overlaps the input gradient's reduction with
the weight-gradient GEMM, and with gradient accumulation fusion (Megatron's
--gradient-accumulation-fusion, on by default) adds the weight gradient straight into the DDP
buffer `weight.main_grad`. On NCCL the overlap needs CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron
requires; megafab warns once if it is not set.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from megafab.distributed.mappings import (
    all_gather_single,
    gather_first_dim,
    group_size,
    reduce_scatter_single,
)
from megafab.run import faults

_warned_connections = False


def _gather_first_dim_async(x: torch.Tensor, group):
    """Start an all-gather along dim 0; returns (output buffer, handle)."""
    out = torch.empty((group_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, all_gather_single(out, x.contiguous(), group=group, async_op=True)


def _warn_device_connections(device: torch.device) -> None:
    global _warned_connections
    if device.type == "cuda" and not _warned_connections and \
            os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        _warned_connections = True
        warnings.warn("set CUDA_DEVICE_MAX_CONNECTIONS=1 so tensor-parallel communication overlaps the "
                      "weight-gradient GEMM in order (Megatron requires it)", stacklevel=3)


def _accumulate_wgrad(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor):
    """main_grad += grad_output^T @ total_input, both flattened to 2-D, without a weight-shaped
    temporary where the dtypes allow it."""
    if main_grad.dtype == grad_output.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    elif grad_output.device.type == "cuda":
        main_grad.add_(torch.mm(grad_output.t(), total_input, out_dtype=main_grad.dtype))
    else:
        main_grad.add_(grad_output.t().mm(total_input))


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """input @ W^T (+ bias) with the tensor-parallel communication folded in. Arguments after bias:

    gradient_accumulation_fusion: add wgrad into weight.main_grad (only if the weight has one)
    allreduce_dgrad: all-reduce the input gradient over `group` (ColumnParallel without SP)
    sequence_parallel: the input is sharded along dim 0 over `group`; gather it here

        forward    SP: all-gather the input [s/tp, b, in] -> [s, b, in]; output = input @ W^T (+ bias)
                   saved for backward: the input AS GIVEN (the sharded [s/tp, b, in] under SP,
                   never the gathered one) and W
        backward   SP: start the all-gather of the saved input again (async)
                   dgrad = grad_output @ W                       [s, b, in]
                   start dgrad's reduction (async): SP reduce-scatter -> [s/tp, b, in], or
                   without SP an all-reduce when allreduce_dgrad (Megatron's f folded in)
                   wait for the input; wgrad = grad_output^T @ input, computed while dgrad's
                   reduction is in flight, added into `weight.main_grad` under fusion
                   wait for the reduction

    Under fusion the weight gradient is accumulated in place (_accumulate_wgrad: addmm_ when the
    dtypes match; a float32 buffer for a bf16/fp16 model takes the product computed in the model
    dtype, or in float32 where torch offers mm(out_dtype)) and the backward returns None for the
    weight: autograd still runs its post-accumulate-grad hook (DDP's bucket bookkeeping) with
    `weight.grad` None, and a second use of the same weight (a tied embedding on one stage)
    arrives there as an ordinary `.grad`.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                group):
        ctx.use_bias = bias is not None
        # Held directly: a tensor restored from save_for_backward (e.g. through saved-tensor hooks)
        # need not be the Parameter object that carries `main_grad`.
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") \
            else None
        ctx.allreduce_dgrad = allreduce_dgrad and group_size(group) > 1
        ctx.sequence_parallel = sequence_parallel and group_size(group) > 1
        ctx.group = group
        ctx.save_for_backward(input, weight)
        total = input
        if ctx.sequence_parallel:
            total = gather_first_dim(input, group)
        if ctx.sequence_parallel or ctx.allreduce_dgrad:
            _warn_device_connections(input.device)
        return torch.nn.functional.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        group = ctx.group
        gather = None
        if ctx.sequence_parallel:
            total, gather = _gather_first_dim_async(input, group)
        else:
            total = input
        grad_input = grad_output.matmul(weight)  # [s, b, in]
        if gather is not None:
            faults.wait(gather, "sequence-parallel all-gather", group)
        reduction = None
        if ctx.sequence_parallel:
            sub = torch.empty((grad_input.shape[0] // group_size(group), *grad_input.shape[1:]),
                              dtype=grad_input.dtype, device=grad_input.device)
            reduction = reduce_scatter_single(sub, grad_input.contiguous(), group=group, async_op=True)
            grad_input = sub  # [s/tp, b, in] once the reduction lands
        elif ctx.allreduce_dgrad:
            reduction = dist.all_reduce(grad_input, group=group, async_op=True)

        go = grad_output.reshape(-1, grad_output.shape[-1])  # [s*b, out]
        ti = total.reshape(-1, total.shape[-1])  # [s*b, in]
        if ctx.main_grad is not None:
            _accumulate_wgrad(ctx.main_grad, go, ti)
            grad_weight = None
        else:
            grad_weight = go.t().matmul(ti)
        grad_bias = go.sum(dim=0) if ctx.use_bias else None
        if reduction is not None:
            faults.wait(reduction, "tensor-parallel gradient reduction", group)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
        input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, group,
        gradient_accumulation_fusion: bool = True, allreduce_dgrad: bool = False,
        sequence_parallel: bool = False) -> torch.Tensor:
    """input [s(/tp), b, in] @ weight[out, in]^T (+ bias) -> [s, b, out] through the core above."""
    if group_size(group) == 1 and not (gradient_accumulation_fusion and hasattr(weight, "main_grad")):
        return torch.nn.functional.linear(input, weight, bias)  # plain autograd: nothing to add
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, group)
