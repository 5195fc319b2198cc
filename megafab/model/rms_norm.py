"""RMSNorm that keeps only its input and one fp32 statistic per token for backward.

torch's nn.RMSNorm is a composite of elementwise ops on CPU (and on older CUDA builds): autograd
then keeps an fp32 copy of the input and the fp32 normalized tensor as well, 2-4x the input's bytes
for a bf16 model. This is the fused form Megatron/Transformer Engine use:

    forward    r = 1 / sqrt(mean(x^2) + eps)   (fp32, [..., 1]);   y = (x * r) * w
    backward   g' = g * w;   dx = r * (g' - x * r^2 * mean(g' * x));   dw = sum(g * x * r)

computed in at least fp32 and cast back; saved: x (as given) and r.
"""

from __future__ import annotations

import torch
from torch import nn


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return ((xf * rstd) * weight.to(compute)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        compute = rstd.dtype
        xf, gf = x.to(compute), grad.to(compute)
        normalized = xf * rstd
        gw = gf * weight.to(compute)
        dx = rstd * (gw - normalized * (gw * normalized).mean(dim=-1, keepdim=True))
        dweight = (gf * normalized).reshape(-1, x.shape[-1]).sum(dim=0)
        return dx.to(x.dtype), dweight.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's last dim scaled by `weight`, through the function above."""
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """Drop-in for nn.RMSNorm(hidden, eps) with a `weight` parameter (same name in checkpoints)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
