"""megatron-core 0.16.1's MLASelfAttention (local spec) on one CPU process, for benchmarks/mla.py.

The shims (benchmark-only, never in megafab) are tests/helpers/mcore_mla.py's, restated here since
benchmarks do not import tests/: a one-rank gloo group with megatron's parallel_state on it;
torch.compile's stance forced eager (megatron's jit_fuser would compile per shape); the RNG
tracker's fork a no-op (no dropout); HAVE_TE False while the layer is built (0.16.1 sets it True
without TE, its TE names then None); and core attention as PyTorch SDPA (causal, MLA's scale: the
kernel megafab's layer calls on CPU), since megatron-core's local DotProductAttention takes no
k/v widths (0.16.1 runs MLA's core attention in Transformer Engine).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F


class SDPACoreAttention(torch.nn.Module):
    """Causal softmax attention with megatron-core's core-attention interface (k/v widths differ)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        out = out.permute(2, 0, 1, 3)
        return out.reshape(out.shape[0], out.shape[1], -1)


@contextlib.contextmanager
def megatron_on_cpu():
    """megatron-core's parallel_state over the one-rank group (made by the caller) and the patches."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.get_cuda_rng_tracker()
    fork = tracker.fork
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    torch.compiler.set_stance("force_eager")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.compiler.set_stance("default")
        torch.cuda.current_device = current_device
        tracker.fork = fork


def megatron_mla(m, dtype=torch.float32):
    """megatron-core's MLASelfAttention for megafab ModelConfig `m` (random weights); call inside
    megatron_on_cpu()."""
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
            apply_rope_fusion=False)
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=m.qk_layernorm,
                                        normalization=m.normalization).submodules.self_attention
        spec.submodules.core_attention = SDPACoreAttention
        have_te = multi_latent_attention.HAVE_TE
        multi_latent_attention.HAVE_TE = False
        try:
            layer = build_module(spec, config=config, layer_number=1)
        finally:
            multi_latent_attention.HAVE_TE = have_te
    return layer.to(dtype)


def megatron_step(layer, x: torch.Tensor) -> torch.Tensor:
    """One forward of megatron-core's layer on x [s, b, h] (causal)."""
    s = x.shape[0]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    out, bias = layer(x, mask)
    return out if bias is None else out + bias


def copy_weights(theirs, ours) -> None:
    """megatron-core's parameters into megafab's layer (the same names)."""
    params = dict(ours.named_parameters())
    theirs_params = dict(theirs.named_parameters())
    assert params.keys() == theirs_params.keys(), (sorted(params), sorted(theirs_params))
    with torch.no_grad():
        for name, p in theirs_params.items():
            params[name].copy_(p)
