"""This device's kernels, each the median of a few timed repeats after a warm-up: GEMMs of the model
dtype over a range of shapes (a profile's gemm_points: the step-time model interpolates the
achieved rate by GEMM size instead of using the analytic curve), causal attention forward and
backward (torch SDPA) as efficiencies of the peak, and a streaming element-wise kernel's HBM
(memory) bandwidth."""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from megafab.calibrate.stats import timed

GEMM_SHAPES = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (256, 512, 256), (512, 512, 512),
               (1024, 512, 512), (1024, 1024, 1024), (2048, 1024, 1024)]


def this_device():
    """The device a rank of this machine computes on: a GPU where there is one."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _mm(a, b, device):
    a @ b
    sync(device)


def measure_gemms(dtype, deadline: float) -> list:
    device = this_device()
    name = str(dtype).replace("torch.", "")
    rows = []
    for m, n, k in GEMM_SHAPES:
        if time.monotonic() > deadline:
            break
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        rows.append([m, n, k, name, timed(functools.partial(_mm, a, b, device))])
    return rows


def measure_attention(dtype, peak: float) -> tuple[float, float]:
    """(forward, backward) efficiency of causal SDPA relative to `peak` FLOP/s, the kernel's own FLOPs."""
    device = this_device()
    b, heads, s, d = 1, 4, 256, 32
    q, k, v = (torch.randn(b, heads, s, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    flops = 4 * b * heads * s * s * d / 2

    def forward():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        sync(device)

    def backward():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        sync(device)

    fwd = timed(forward)
    both = timed(backward)
    return flops / fwd / peak, 2.5 * flops / max(both - fwd, fwd) / peak


def measure_bandwidth() -> float:
    device = this_device()
    x = torch.empty(2**24, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)

    def run():
        torch.mul(x, 2.0, out=y)
        sync(device)

    return 2 * x.numel() * 4 / timed(run)
