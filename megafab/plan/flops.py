"""Model FLOPs per iteration and MFU, as Megatron's throughput line computes them.

For a GPT with l layers, hidden h, sequence s, vocab V, batch B (samples per iteration), the
dense model FLOPs of forward + backward (backward = 2x forward) without recompute are

    72 * B * s * l * h^2 * (1 + s / (6h) + V / (12 l h))

derived from: per layer 24 B s h^2 in the QKV/projection/MLP matmuls (ffn = 4h) plus 4 B s^2 h in
attention scores and context, and 2 B s h V for the logits; times 3 for forward + backward.
Here the general form counts GQA, SwiGLU and any ffn size, and reduces to the above for the
GPT-3 shape. An MoE layer's MLP counts its k routed experts and the shared experts, as Megatron's
num_floating_point_operations does (megafab.plan.moe.mlp_flops_per_token). Attention counts the full
s x s score and context matrices (Megatron-LM up to core 0.15; 0.16 counts the causal half, 2 s^2
a d less per layer and sequence in forward).
"""

from __future__ import annotations

from megafab.config.moe import moe_settings
from megafab.plan.moe import is_moe_layer, mlp_flops_per_token

# Dense bf16 peak TFLOP/s by GPU name fragment (vendor datasheets).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def flops_per_iteration(cfg, batch_samples: int) -> float:
    m = cfg.model
    s, h, n_layers = m.seq_length, m.hidden_size, m.num_layers
    d, heads, groups = m.kv_channels, m.num_attention_heads, m.num_query_groups
    vocab = m.padded_vocab_size
    qkv = 2 * s * h * (heads + 2 * groups) * d
    proj = 2 * s * heads * d * h
    attn = 2 * 2 * s * s * heads * d  # scores and context (full matrices: see the docstring)
    moe = moe_settings(cfg)
    mlp = sum(s * mlp_flops_per_token(m, moe, is_moe_layer(moe, i)) for i in range(n_layers))
    logits = 2 * s * h * vocab
    forward = n_layers * (qkv + proj + attn) + mlp + logits
    return 3.0 * forward * batch_samples


def peak_tflops(device) -> float | None:
    """Peak dense bf16 TFLOP/s of the GPU, None on CPU or an unknown GPU."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None
