"""Multi-latent attention (DeepSeek-V2/V3; megatron-core 0.16.1's MLASelfAttention, local spec).

    q   = up_q(q_layernorm(down_q(x)))  [heads, qk + pe]   (--q-lora-rank; none: linear_q_proj(x))
    kv  = down_kv(x) = [latent kvr | k_pe pe]; k, v = up_kv(kv_layernorm(latent))  [heads, qk | v]
    q's pe part and k_pe (one for all heads) are rotated (model/rotary.py, MLA's channel order);
    attention scale yarn_mscale(factor, mscale_all_dim)^2 / sqrt(qk + pe); out = linear_proj(ctx)

Every projection is column-parallel (the local spec's) and bias-free; linear_proj is row-parallel.
The down projections' outputs are gathered over TP (and the latents scattered back to the sequence
shards under SP), as megatron-core does; the norms exist with --qk-layernorm only. One difference:
k_pe feeds only this rank's heads, so its gradient is summed over TP here (copy_to region) -- the
local spec drops the other ranks' part (Megatron-LM issue 1699), so megafab's TP equals TP 1.
--recompute-modules mla_up_proj discards the up projections' outputs until backward needs them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megafab.distributed.context_parallel import context_parallel_attention
from megafab.distributed.layers import ColumnParallelLinear, RowParallelLinear
from megafab.distributed.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_size,
    scatter_to_sequence_parallel_region,
)
from megafab.distributed.masked_attention import attention
from megafab.distributed.random import host_seed
from megafab.model.attention_backend import sdpa_context
from megafab.model.init import normal_init, output_layer_std
from megafab.model.norms import build_norm
from megafab.model.recompute import DiscardedOutput, RecomputeSettings, recompute
from megafab.model.rotary import apply_rotary, mla_softmax_scale


class MLASelfAttention(nn.Module):
    """Causal multi-latent self-attention, heads split over TP (see the module docstring)."""

    def __init__(self, cfg, ctx, prefix: str):
        super().__init__()
        self.ctx = ctx
        self.heads = cfg.num_attention_heads // group_size(ctx.tp_group)
        self.qk, self.pe, self.v = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.scale = mla_softmax_scale(cfg)
        self.dropout = cfg.attention_dropout
        recompute_settings = RecomputeSettings.from_model_config(cfg)
        self.recompute_core_attention = recompute_settings.core_attention
        self.recompute_up_proj = recompute_settings.selects("mla_up_proj")
        self.sdpa_backend = sdpa_context(cfg.attention_backend)

        def column(name: str, n_in: int, n_out: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                n_in, n_out, tp_group=ctx.tp_group, bias=False, sequence_parallel=ctx.sequence_parallel,
                params_dtype=ctx.params_dtype, device=ctx.device,
                gradient_accumulation_fusion=ctx.gradient_accumulation_fusion,
                init_method=normal_init(ctx.seed, prefix + name + ".weight", cfg.init_method_std))

        heads = cfg.num_attention_heads
        self.linear_proj = RowParallelLinear(
            heads * self.v, cfg.hidden_size, tp_group=ctx.tp_group, bias=cfg.add_bias_linear,
            input_is_parallel=True, sequence_parallel=ctx.sequence_parallel, params_dtype=ctx.params_dtype,
            device=ctx.device, gradient_accumulation_fusion=ctx.gradient_accumulation_fusion,
            init_method=normal_init(ctx.seed, prefix + "linear_proj.weight",
                                    output_layer_std(cfg.init_method_std, cfg.num_layers)))
        q_out = heads * (self.qk + self.pe)
        if self.q_lora_rank is None:
            self.linear_q_proj = column("linear_q_proj", cfg.hidden_size, q_out)
        else:
            self.linear_q_down_proj = column("linear_q_down_proj", cfg.hidden_size, self.q_lora_rank)
            self.linear_q_up_proj = column("linear_q_up_proj", self.q_lora_rank, q_out)
        self.linear_kv_down_proj = column("linear_kv_down_proj", cfg.hidden_size, self.kv_lora_rank + self.pe)
        self.linear_kv_up_proj = column("linear_kv_up_proj", self.kv_lora_rank, heads * (self.qk + self.v))
        # the latent norms: the latents are sequence-sharded under SP (their grads partial over TP
        # then: build_norm marks them sequence_parallel), whole and replicated otherwise
        self.q_layernorm = self.kv_layernorm = None
        if cfg.qk_layernorm and self.q_lora_rank is not None:
            self.q_layernorm = build_norm(cfg, ctx, self.q_lora_rank)
        if cfg.qk_layernorm:
            self.kv_layernorm = build_norm(cfg, ctx, self.kv_lora_rank)

    def _latent(self, down: torch.Tensor) -> torch.Tensor:
        """A column-parallel down projection's [s, b, r/tp] -> the whole latent, [s(/tp), b, r]; a
        duplicated one's (Transformer Engine's, model/te_wrap.py) is that already."""
        if down.shape[-1] == self.q_lora_rank:
            return down
        full = gather_from_tensor_model_parallel_region(down, self.ctx.tp_group)
        if self.ctx.sequence_parallel:
            full = scatter_to_sequence_parallel_region(full, self.ctx.tp_group)
        return full

    def _up_params(self):
        q = self.linear_q_proj if self.q_lora_rank is None else self.linear_q_up_proj
        return (*q.parameters(), *self.linear_kv_up_proj.parameters())

    def up_proj_and_rope(self, q_in, kv_latent, k_pe, cos=None, sin=None):
        """(q_latent or x, normed kv latent, k_pe [s, b, pe]) -> q, k [s, b, heads/tp, qk + pe] and
        v [s, b, heads/tp, v]: the region --recompute-modules mla_up_proj recomputes."""
        q, _ = (self.linear_q_proj if self.q_lora_rank is None else self.linear_q_up_proj)(q_in)
        s, b = q.shape[:2]
        q_nope, q_pe = q.view(s, b, self.heads, self.qk + self.pe).split([self.qk, self.pe], dim=-1)
        kv, _ = self.linear_kv_up_proj(kv_latent)
        k_nope, v = kv.view(s, b, self.heads, self.qk + self.v).split([self.qk, self.v], dim=-1)
        k_pe = k_pe.unsqueeze(2)  # [s, b, 1, pe]: one for every head
        if cos is not None:
            q_pe = apply_rotary(q_pe, (cos, sin), pairs=True)
            k_pe = apply_rotary(k_pe, (cos, sin), pairs=True)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.heads, -1)], dim=-1)
        return q, k, v.contiguous()

    def forward(self, x, rotary_angles=None, attention_mask=None, kv_cache=None):
        """x [s(/tp), b, h] -> [s(/tp), b, h]; rotary_angles: (cos, sin) [s, b, 1, pe] of these
        positions (GPTModel's RotaryEmbedding over qk_pos_emb_head_dim channels)."""
        group = self.ctx.tp_group
        q_in = x
        if self.q_lora_rank is not None:
            q_in = self._latent(self.linear_q_down_proj(x)[0])  # [s(/tp), b, q_lora_rank]
            if self.q_layernorm is not None:
                q_in = self.q_layernorm(q_in)
        kv = self.linear_kv_down_proj(x)[0]
        if kv.shape[-1] == self.kv_lora_rank + self.pe:  # duplicated (TE) or TP 1: this rank's tokens
            kv_latent, k_pe = kv.split([self.kv_lora_rank, self.pe], dim=-1)
            k_pe = gather_from_sequence_parallel_region(k_pe, group) if self.ctx.sequence_parallel else \
                copy_to_tensor_model_parallel_region(k_pe, group)  # each rank's heads: sum the grads
        else:
            kv = gather_from_tensor_model_parallel_region(kv, group)  # [s, b, kvr+pe]
            kv_latent, k_pe = kv.split([self.kv_lora_rank, self.pe], dim=-1)
            if self.ctx.sequence_parallel:
                kv_latent = scatter_to_sequence_parallel_region(kv_latent, group)
            k_pe = copy_to_tensor_model_parallel_region(k_pe, group)  # each rank's heads: sum the grads
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        region = DiscardedOutput(self.up_proj_and_rope, self._up_params(),
                                 self.recompute_up_proj and self.training)
        q, k, v = region(q_in, kv_latent, k_pe, *(rotary_angles or ()))
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads/tp, s, d]
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # [b, heads/tp, s_cached + s, d]
        dropout = self.dropout if self.training else 0.0
        if self.recompute_core_attention and self.training:
            out = recompute(self.core_attention, q, k, v, attention_mask, dropout,
                            tracker=self.ctx.rng_tracker, device=self.ctx.device)
        else:
            out = self.core_attention(q, k, v, attention_mask, dropout)
        region.discard(out)
        out, _ = self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))  # [s, b, heads/tp * v]
        return out

    def core_attention(self, q, k, v, attention_mask, dropout):
        """q, k [b, heads, s, qk + pe], v [b, heads, s, v] -> [b, heads, s, v] (the scale: MLA's).
        Under context parallelism v (or q and k) is zero-padded to one width (CP attention moves k
        and v as one tensor) and the padding cut from the output: the same values."""
        with self.ctx.tp_region_rng() if dropout > 0 else contextlib.nullcontext(), self.sdpa_backend():
            if self.ctx.cp_group is not None:
                seed = host_seed(self.ctx.rng_tracker) if dropout > 0 else None
                width = max(q.shape[-1], v.shape[-1])
                q, k, padded = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
                out = context_parallel_attention(q, k, padded, self.ctx.cp_group, self.ctx.cp_comm_type,
                                                 dropout, seed, scale=self.scale, mask=attention_mask)
                return out[..., :v.shape[-1]]
            return attention(q, k, v, attention_mask, dropout_p=dropout, scale=self.scale)  # SDPA
