"""Fused attention kernels that return the log-sum-exp, for one block of context-parallel attention.

    device  dtypes            kernel (torch.ops.aten)
    cpu     fp64 fp32 bf16 fp16  _scaled_dot_product_flash_attention_for_cpu (+ _backward); GQA native
    cuda    bf16 fp16, d<=256   _scaled_dot_product_flash_attention (+ _backward); K/V heads repeated
    else    (dropout > 0, fp32/fp64 on CUDA, other devices)  blockwise_attention.ReferenceKernel

Every kernel has ReferenceKernel's interface (forward -> (out, lse, aux); backward from the *merged*
out and lse of all blocks -> (dq, dk, dv)). Neither fused kernel takes dropout in a form whose masks
a later block backward could replay, so attention dropout runs on the reference kernel. The CUDA
call was written from its schema in torch 2.13 on a CPU machine; benchmarks/gpu_cp_check.py checks
it against the reference on a GPU.
"""

from __future__ import annotations

import torch

from megafab.distributed.blockwise_attention import BlockDropout, ReferenceKernel

aten = torch.ops.aten
IMPLEMENTATIONS = ("auto", "reference")
_CUDA_FLASH_DTYPES = (torch.float16, torch.bfloat16)


class CpuFlashKernel:
    def forward(self, q, k, v, causal: bool, scale: float, block_id: int = 0):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, block_id: int = 0, aux=None):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out, lse, 0.0, causal, scale=scale)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


class CudaFlashKernel:
    def forward(self, q, k, v, causal: bool, scale: float, block_id: int = 0):
        heads = q.shape[1]
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, _heads(k, heads), _heads(v, heads), 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, block_id: int = 0, aux=None):
        heads, groups = q.shape[1], k.shape[1]
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout.to(q.dtype), q, _heads(k, heads), _heads(v, heads), out, lse.contiguous(), cum_q, cum_k,
            max_q, max_k, 0.0, causal, seed, offset, scale=scale)
        if groups != heads:
            dk, dv = (x.unflatten(1, (groups, -1)).sum(2) for x in (dk, dv))
        return dq, dk, dv


CPU_FLASH, CUDA_FLASH = CpuFlashKernel(), CudaFlashKernel()


def block_kernel(q: torch.Tensor, dropout_p: float = 0.0, seed: int = 0, implementation: str = "auto"):
    """The kernel for blocks shaped like q [b, heads, s, d]: fused where one applies (table above)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")
    if dropout_p > 0:
        return ReferenceKernel(BlockDropout(dropout_p, seed))
    if implementation == "auto":
        if q.device.type == "cpu":
            return CPU_FLASH
        d = q.shape[-1]
        if q.device.type == "cuda" and q.dtype in _CUDA_FLASH_DTYPES and d % 8 == 0 and d <= 256:
            return CUDA_FLASH
    return ReferenceKernel()
