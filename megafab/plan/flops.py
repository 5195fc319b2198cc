"""Model FLOPs per iteration and MFU, as Megatron's throughput line computes them.

For a GPT with l layers, hidden h, sequence s, vocab V, batch B (samples per iteration), the
dense model FLOPs of forward + backward (backward = 2x forward) without recompute are

    72 * B * s * l * h^2 * (1 + s / (6h) + V / (12 l h))

derived from: per layer 24 B s h^2 in the QKV/projection/MLP matmuls (ffn = 4h) plus 4 B s^2 h in
attention scores and context, and 2 B s h V for the logits; times 3 for forward + backward.
Here each layer's matmuls are read off the layer the engine builds (megafab.plan.inventory): 2 FLOPs
per token for each element of its linear weights, as Megatron's num_floating_point_operations counts
(GQA, SwiGLU, any ffn size; an MoE layer's k routed experts and its shared experts, not the router's
2 h E nor the shared experts' gate); it reduces to the above for the GPT-3 shape. Attention counts the
full s x s score and context matrices (Megatron-LM up to core 0.15; 0.16 counts the causal half,
2 s^2 a d less per layer and sequence in forward); MLA's: 2 s^2 a (qk + pe + v). Sliding-window
layers (--window-size) count full attention too, as Megatron-LM HEAD's num_floating_point_operations.
"""

from __future__ import annotations

import functools

from megafab.config.moe import moe_settings
from megafab.param_names import ROUTER, parse_index
from megafab.plan.inventory import Inventory, Part

# Dense bf16 peak TFLOP/s by GPU name fragment (vendor datasheets).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


@functools.cache
def matmul_weights(part: Part, topk: int = 0) -> int:
    """Linear-weight elements one token passes through in a layer: its `.weight` tensors of two or
    more dims (norms, biases and the shared experts' gate vector are not matmuls), the router's left
    out as Megatron does, the routed experts at topk of the rank's local ones."""
    dense = expert = 0
    for t in part.tensors:
        if len(t.shape) < 2 or not t.name.endswith(".weight") or parse_index(t.name)[1].startswith(ROUTER):
            continue
        if t.expert:
            expert += t.numel
        else:
            dense += t.numel
    return dense + (expert // part.local_experts * topk if expert else 0)


def flops_per_iteration(cfg, batch_samples: int) -> float:
    m = cfg.model
    s, h = m.seq_length, m.hidden_size
    moe = moe_settings(cfg)
    layers = Inventory(m, moe)  # TP 1: the whole layers
    topk = moe.moe_router_topk if moe is not None else 0
    matmuls = sum(matmul_weights(layers.layer(i), topk) for i in range(m.num_layers))
    attn = 2 * 2 * s * s * m.num_attention_heads * m.kv_channels  # scores and context (see the docstring)
    if m.multi_latent_attention:  # scores over qk + pe channels, context over v's
        attn = 2 * s * s * m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim)
    logits = 2 * s * h * m.padded_vocab_size
    forward = 2 * s * matmuls + m.num_layers * attn + logits
    if m.mtp_num_layers:  # each MTP depth: eh_proj, a layer of the last layer's kind, attention, logits
        tail = layers.ends(False, True).tail.tensors
        eh_proj = sum(t.numel for t in tail if t.name.endswith("eh_proj.weight"))
        layer = matmul_weights(layers.layer(m.num_layers - 1), topk)
        forward += 2 * s * (eh_proj + m.mtp_num_layers * layer) + m.mtp_num_layers * (attn + logits)
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
