"""Rotary position embeddings: RoPE and YaRN (megatron-core's RotaryEmbedding / YarnRotaryEmbedding).

GPTModel computes the angles once per forward from the tokens' positions (RotaryEmbedding, on
`rotary_dim(cfg)` channels) and every layer rotates with apply_rotary. Standard attention rotates the
first channels of each head, halves paired (not interleaved); multi-latent attention rotates its
qk_pos_emb_head_dim part with channel pairs (2i, 2i+1) gathered into halves first, as megatron-core's
apply_rotary_pos_emb(multi_latent_attention=True) does (its output keeps that order). YaRN mixes
interpolated and original frequencies over a ramp between the correction range's ends and scales cos
and sin by its attention factor (mscale / mscale_all_dim); multi-latent attention also squares
yarn_mscale(scale, mscale_all_dim) into its softmax scale (mla_softmax_scale). Angles are computed in
float64 (megatron-core uses float32) and cast to the model's dtype. Plain RoPE also takes Llama 3's
frequency scaling (Llama3Scaling) and linear position interpolation (positions / factor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Yarn:
    """YaRN's settings, megatron-core's defaults (YarnRotaryEmbedding)."""

    scale: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True

    @classmethod
    def from_model_config(cls, m) -> Yarn | None:
        """The YaRN of model config `m`; None when its RoPE is plain (rope_kind)."""
        if rope_kind(m) != "yarn":
            return None
        given = {"original_max_position_embeddings": m.yarn_original_max_position_embeddings,
                 "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow}
        return cls(scale=m.rotary_scaling_factor, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim,
                   round_to_int=m.yarn_correction_range_round_to_int,
                   **{k: v for k, v in given.items() if v is not None})

    def attention_factor(self) -> float:
        """The factor on cos and sin (megatron-core's concentration factor)."""
        return yarn_mscale(self.scale, self.mscale) / yarn_mscale(self.scale, self.mscale_all_dim)

    def inv_freq(self, dim: int, base: float, device) -> torch.Tensor:
        """[dim/2] frequencies: interpolated (/ scale) below the correction range, original above it."""
        extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
        inter = extra / self.scale
        low, high = (_correction_dim(beta, dim, base, self.original_max_position_embeddings)
                     for beta in (self.beta_fast, self.beta_slow))
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high  # no zero-width ramp
        # the ramp from host values: no clamp on a meta tensor (plan/inventory.py builds layers there)
        ramp = torch.tensor([min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)],
                            dtype=torch.float64, device=device)
        keep = 1.0 - ramp  # 1: the original frequency
        return inter * (1 - keep) + extra * keep


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.x RoPE scaling (megatron-core's RotaryEmbedding._apply_scaling, HF's rope_type llama3):
    wavelengths above original / low_freq_factor are divided by factor, those below original /
    high_freq_factor kept, the ones between mixed by a smooth factor."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_model_config(cls, m) -> Llama3Scaling | None:
        """The scaling of model config `m`; None without --use-rope-scaling (or off plain RoPE)."""
        if not m.use_rope_scaling or rope_kind(m) != "rope" or m.multi_latent_attention:
            return None
        return cls(m.rope_scaling_factor, m.rope_scaling_low_freq_factor, m.rope_scaling_high_freq_factor,
                   m.rope_scaling_original_max_position_embeddings)

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)


def position_interpolation(m) -> float | None:
    """--rotary-seq-len-interpolation-factor where megatron-core applies it (plain RoPE of standard
    attention; its YaRN and multi-latent attention ignore it)."""
    if rope_kind(m) != "rope" or m.multi_latent_attention:
        return None
    return m.rotary_seq_len_interpolation_factor


def rope_scaling_problems(m) -> list[str]:
    """Llama 3.x scaling's and position interpolation's rules (one line each)."""
    out = []
    plain = rope_kind(m) == "rope" and not m.multi_latent_attention
    factor = m.rotary_seq_len_interpolation_factor
    for flag, on in (("--use-rope-scaling", m.use_rope_scaling),
                     ("--rotary-seq-len-interpolation-factor", factor is not None)):
        if on and not plain:
            out.append(f"{flag} scales plain RoPE of standard attention (megatron-core's RotaryEmbedding); "
                       f"with {'multi-latent attention' if m.multi_latent_attention else 'YaRN or no RoPE'} "
                       f"it would have no effect: use --position-embedding-type rope or drop it")
    if factor is not None and not factor > 0:
        out.append(f"--rotary-seq-len-interpolation-factor {factor} must be positive")
    if m.use_rope_scaling:
        if not m.rope_scaling_factor > 0:
            out.append(f"--rope-scaling-factor {m.rope_scaling_factor} must be positive")
        if not 0 < m.rope_scaling_low_freq_factor < m.rope_scaling_high_freq_factor:
            out.append(f"--rope-scaling-low-freq-factor {m.rope_scaling_low_freq_factor} must be positive "
                       f"and below --rope-scaling-high-freq-factor {m.rope_scaling_high_freq_factor}")
        if not m.rope_scaling_original_max_position_embeddings > 0:
            out.append(f"--rope-scaling-original-max-position-embeddings "
                       f"{m.rope_scaling_original_max_position_embeddings} must be positive")
    return out


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_kind(m) -> str | None:
    """"rope", "yarn" or None (no rotary embedding) for model config `m`: multi-latent attention
    always rotates (--rope-type, default yarn); standard attention per --position-embedding-type."""
    if m.multi_latent_attention:
        return m.rope_type or "yarn"
    return m.position_embedding_type if m.position_embedding_type in ("rope", "yarn") else None


def rotary_dim(m) -> int:
    """The channels each head's RoPE part has (before --rotary-percent)."""
    return m.qk_pos_emb_head_dim if m.multi_latent_attention else m.kv_channels


def rotary_channels(m) -> int:
    """The channels RotaryEmbedding rotates (its cos and sin width); 0 without a rotary embedding."""
    kind = rope_kind(m)
    if kind is None:
        return 0
    return rotary_dim(m) if kind == "yarn" else int(rotary_dim(m) * m.rotary_percent)


def mla_softmax_scale(m) -> float:
    """Multi-latent attention's softmax scale: yarn_mscale(factor, mscale_all_dim)^2 / sqrt(q head)."""
    m_all = yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim)
    return m_all * m_all / math.sqrt(m.qk_head_dim + m.qk_pos_emb_head_dim)


class RotaryEmbedding(nn.Module):
    """RoPE on the first rotary_percent of each head's channels (YaRN: all of them)."""

    def __init__(self, kv_channels: int, rotary_percent: float, base: int, device, yarn: Yarn | None = None,
                 llama3: Llama3Scaling | None = None, interpolation: float | None = None,
                 interleaved: bool = False):
        super().__init__()
        self.interpolation = interpolation
        self.interleaved = interleaved  # --rotary-interleaved: frequency i on channels 2i and 2i + 1
        self.dim = kv_channels if yarn is not None else int(kv_channels * rotary_percent)
        self.factor = 1.0 if yarn is None else yarn.attention_factor()
        if yarn is None:
            exponent = torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim
            inv_freq = 1.0 / (base**exponent)
            if llama3 is not None:
                inv_freq = llama3.apply(inv_freq)
        else:
            inv_freq = yarn.inv_freq(self.dim, base, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_model_config(cls, m, device) -> RotaryEmbedding:
        yarn = Yarn.from_model_config(m)
        return cls(rotary_dim(m), m.rotary_percent, m.rotary_base, device, yarn,
                   Llama3Scaling.from_model_config(m), position_interpolation(m), m.rotary_interleaved)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, s] -> (cos, sin), each [s, b, 1, dim] in `dtype`, computed once per forward
        and shared by every layer (so backward keeps one copy, not one per layer and q/k)."""
        positions = position_ids.to(torch.float64).t()
        if self.interpolation is not None:
            positions = positions / self.interpolation
        freqs = positions[..., None] * self.inv_freq  # [s, b, dim/2]
        if self.interleaved:
            angles = torch.stack([freqs, freqs], dim=-1).flatten(-2)[:, :, None, :]
        else:
            angles = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
        if self.factor == 1.0:
            return angles.cos().to(dtype), angles.sin().to(dtype)
        return (angles.cos() * self.factor).to(dtype), (angles.sin() * self.factor).to(dtype)


def apply_rotary(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                 pairs: bool = False, interleaved: bool = False) -> torch.Tensor:
    """x [s, b, heads, d]; rotates the first cos.shape[-1] channels by RotaryEmbedding's (cos, sin).
    pairs: multi-latent attention's order (channels 2i and 2i+1 gathered into the halves first);
    interleaved: --rotary-interleaved, channels 2i and 2i+1 rotated in place (the angles' own order)."""
    cos, sin = rotary
    dim = cos.shape[-1]
    rot, keep = x[..., :dim], x[..., dim:]
    if pairs:
        rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
    if interleaved:
        rotated = torch.stack([-rot[..., 1::2], rot[..., 0::2]], dim=-1).flatten(-2)
    else:
        half1, half2 = rot.chunk(2, dim=-1)
        rotated = torch.cat([-half2, half1], dim=-1)
    return torch.cat([rot * cos + rotated * sin, keep], dim=-1)
