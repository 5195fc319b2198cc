"""Multi-latent attention in the tests: the tiny MLA model style (tiny.py's sizes; YaRN on with a
correction range whose ramp values are exact binary fractions) and megatron-core 0.16.1's
MLASelfAttention (local spec) as the oracle, built inside tests/helpers/mcore_moe.py's CPU patches.

megatron-core computes RoPE angles in float32; for the float64 comparison its rotary module's
frequencies are replaced by the same values in float64 (to_float64_rope; a test-only shim, the
math it runs is megatron-core's own). Its local DotProductAttention takes no k_channels/v_channels
(0.16.1's MLA runs core attention in Transformer Engine), so the oracle's core attention is
MathCoreAttention: softmax(q k^T * MLA's softmax_scale, causal) v written out; the projections,
latents, norms, RoPE and scale around it are megatron-core's. Its HAVE_TE is True even without TE
(the TE layer names are None then): False while the layer is built."""

from __future__ import annotations

import warnings

import torch

# MLA + YaRN sizes (TP 2 divides q_lora_rank, kv_lora_rank + qk_pos_emb_head_dim and the heads).
# YaRN over qk_pos_emb_head_dim 16, base 10000, original length 4096: correction range [2, 6], so the
# ramp (i - 2) / 4 is exact in float32 (megatron-core computes it there).
MLA_STYLE = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                 untie_embeddings_and_output_weights=True, add_bias_linear=False, multi_latent_attention=True,
                 qk_layernorm=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=16,
                 v_head_dim=12, rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.707)


class MathCoreAttention(torch.nn.Module):
    """Causal softmax attention with megatron-core's core-attention interface (k/v widths differ)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None):
        # [s, b, n, d] -> scores [b, n, s, s]
        scores = torch.einsum("sbnd,tbnd->bnst", query, key) * self.softmax_scale
        scores = scores.masked_fill(attention_mask, float("-inf"))
        out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(dim=-1), value)
        return out.reshape(out.shape[0], out.shape[1], -1)


def megatron_mla(m, dtype=torch.float64, seed: int = 0, **parallel):
    """megatron-core's MLASelfAttention (local spec) for megafab ModelConfig `m`, random weights (norms
    moved off 1); call inside mcore_moe.megatron_moe_on_cpu."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = MLATransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            ffn_hidden_size=m.ffn_hidden_size, normalization=m.normalization,
            layernorm_epsilon=m.norm_epsilon,
            add_bias_linear=m.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, params_dtype=dtype, gradient_accumulation_fusion=False,
            qk_layernorm=m.qk_layernorm, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
            qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
            rope_type=m.rope_type or "yarn", rotary_base=m.rotary_base, rotary_percent=m.rotary_percent,
            rotary_scaling_factor=m.rotary_scaling_factor, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim,
            apply_rope_fusion=False, **parallel)
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=m.qk_layernorm,
                                        normalization=m.normalization).submodules.self_attention
        spec.submodules.core_attention = MathCoreAttention
        have_te = multi_latent_attention.HAVE_TE  # True without TE too (its layer names are then None)
        multi_latent_attention.HAVE_TE = False
        try:
            layer = build_module(spec, config=config, layer_number=1)
        finally:
            multi_latent_attention.HAVE_TE = have_te
    layer = layer.to(dtype)  # its norms are built in float32
    if dtype == torch.float64:
        to_float64_rope(layer.rotary_pos_emb, m.rotary_base)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return layer


def to_float64_rope(rotary, base: float) -> None:
    """megatron-core's RotaryEmbedding / YarnRotaryEmbedding frequencies in float64 (the same formula)."""
    if hasattr(rotary, "inv_freq_extra"):  # YaRN: extra / inter, its ramp mask stays megatron's
        dim = rotary.dim
        rotary.inv_freq_extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        rotary.inv_freq_inter = rotary.inv_freq_extra / rotary.scaling_factor
    else:
        dim = 2 * rotary.inv_freq.numel()
        rotary.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    type(rotary).forward.cache_clear()  # its lru_cache keeps float32 angles otherwise


def megatron_forward(layer, x: torch.Tensor) -> torch.Tensor:
    s = x.shape[0]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    out, bias = layer(x, mask)
    return out if bias is None else out + bias


def copy_from_megatron(theirs, ours) -> None:
    params = dict(ours.named_parameters())
    theirs_params = dict(theirs.named_parameters())
    assert params.keys() == theirs_params.keys(), (sorted(params), sorted(theirs_params))
    with torch.no_grad():
        for name, p in theirs_params.items():
            params[name].copy_(p)
