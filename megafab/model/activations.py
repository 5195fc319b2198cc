"""The MLP activation of megatron-core 0.16.1 (dense MLP, routed and shared experts alike).

Plain: act(fc1(x)) with act exact GELU, tanh GELU (--openai-gelu) or relu^2 (--squared-relu).
Gated linear unit (--swiglu: act = silu; --quick-geglu: act = quick_gelu(x) = x * sigmoid(1.702 x)),
fc1 packed [gate; linear] along its output (each TP rank [gate_r; linear_r]), fc1's bias added first:

    gate = min(gate, c); linear = clamp(linear, -c, c)     (--activation-func-clamp-value c)
    out  = act(gate) * (linear + offset)                   (--glu-linear-offset, default 0)

which is megatron-core's unfused `glu` (MLP, TEGroupedMLP, HEAD's shared experts) and gpt-oss's
clamped GLU (HF GptOssExperts: alpha 1.702, limit 7, linear + 1). Megatron's fused
weighted_bias_quick_geglu clamps fc1's output before adding its bias; megafab never fuses, so the
bias always comes first (as TEGroupedMLP's fc1 adds it inside the GEMM).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

QUICK_GELU_ALPHA = 1.702


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU (HF's gelu_new, Megatron's openai_gelu)."""
    return F.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's quick_gelu: the sigmoid approximation of GELU."""
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


def mlp_activation(cfg):
    """The elementwise function: silu (--swiglu), quick_gelu (--quick-geglu), else exact GELU unless
    --openai-gelu or --squared-relu."""
    if cfg.swiglu:
        return F.silu
    if cfg.quick_geglu:
        return quick_gelu
    return squared_relu if cfg.squared_relu else openai_gelu if cfg.openai_gelu else F.gelu


def gated_linear_unit(cfg) -> bool:
    """Whether the MLP is gated (fc1 twice as wide, packed [gate; linear], split with stride 2)."""
    return bool(cfg.swiglu or cfg.quick_geglu)


class MLPActivation:
    """fc1's output (bias included) -> fc2's input, [..., fc1_out] -> [..., ffn]."""

    def __init__(self, fn, gated: bool, clamp: float | None = None, offset: float = 0.0):
        self.fn, self.gated, self.clamp, self.offset = fn, gated, clamp, offset

    @classmethod
    def from_model_config(cls, cfg) -> MLPActivation:
        gated = gated_linear_unit(cfg)
        return cls(mlp_activation(cfg), gated, cfg.activation_func_clamp_value if gated else None,
                   cfg.glu_linear_offset if gated else 0.0)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.fn(h)
        gate, linear = h.chunk(2, dim=-1)
        if self.clamp is not None:
            gate = gate.clamp(max=self.clamp)
            linear = linear.clamp(min=-self.clamp, max=self.clamp)
        if self.offset:
            linear = linear + self.offset
        return self.fn(gate) * linear


def activation_problems(m) -> list[str]:
    """The activation flags' rules (Megatron asserts --quick-geglu without --swiglu; the clamp and
    the offset act on a gated unit only, where Megatron would ignore them silently)."""
    out = []
    gated = gated_linear_unit(m)
    for flag, value, off in (("--activation-func-clamp-value", m.activation_func_clamp_value, None),
                             ("--glu-linear-offset", m.glu_linear_offset, 0.0)):
        if value != off and not gated:
            out.append(f"{flag} {value} acts only on a gated linear unit, and this MLP has none; add "
                       f"--quick-geglu (or --swiglu), or remove {flag}")
    clamp = m.activation_func_clamp_value
    if clamp is not None and not (math.isfinite(clamp) and clamp > 0):
        out.append(f"--activation-func-clamp-value {clamp} must be finite and greater than zero (it "
                   f"clamps the gate from above and the linear half to [-value, value])")
    return out
