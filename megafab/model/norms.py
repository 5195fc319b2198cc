"""The norms of a layer: --normalization LayerNorm or RMSNorm, zero-centered with
--apply-layernorm-1p (build_norm)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from megafab.model.rms_norm import RMSNorm, rms_norm


class ZeroCenteredLayerNorm(nn.LayerNorm):
    """--apply-layernorm-1p: LayerNorm whose stored weight is gamma - 1 (starts at 0)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.weight)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """--apply-layernorm-1p with RMSNorm (Transformer Engine's zero_centered_gamma)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(hidden_size, eps, device=device, dtype=dtype)
        nn.init.zeros_(self.weight)

    def forward(self, x):
        return rms_norm(x, self.weight + 1, self.eps)


def build_norm(cfg, ctx, width: int | None = None) -> nn.Module:
    """A --normalization norm over `width` (default hidden_size) channels, zero-centered with
    --apply-layernorm-1p. Its params are marked sequence_parallel (their grads are partial sums
    over the sequence shards under SP)."""
    rms = cfg.normalization == "RMSNorm"
    if cfg.apply_layernorm_1p:
        cls = ZeroCenteredRMSNorm if rms else ZeroCenteredLayerNorm
    else:
        cls = RMSNorm if rms else nn.LayerNorm
    norm = cls(width or cfg.hidden_size, eps=cfg.norm_epsilon, device=ctx.device, dtype=ctx.params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = ctx.sequence_parallel
    return norm
