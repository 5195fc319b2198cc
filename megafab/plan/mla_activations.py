"""Activation bytes of a multi-latent attention layer's attention (model/mla.py), per micro-batch on
one rank: what replaces the QKV terms of plan/activations.py's layer_activation_bytes for MLA.

Notation as there (s tokens of this rank, b micro-batch, t TP, r = t with SP, e bytes), plus n heads,
qk / pe / v head widths, ql query latent (0 without --q-lora-rank), kl kv latent:
    latents      e*s*b*(ql + kl)/t under SP (the scattered copies the norms and up projections keep),
                 e*s*b*(ql + kl + pe) without it (views of the down projections' outputs)
    latent norms e*s*b*(ql + kl)/r for their outputs, fp32 rstd per token each (--qk-layernorm)
    q, k, v      e*s*b*n*(2*(qk + pe) + v)/t: the up projections' rotated q, k and v, as the kernel
                 (or core_attn's checkpoint) keeps them
    projection   e*s*b*n*v/t, its input
    kernel       flash (GPU: the memory-efficient kernel, q and v widths differ): e*s*b*n*v/t + 4*n*s*b/t
                 (output, log-sum-exp); unfused: the probabilities; cpu: PyTorch's math kernel (its
                 flash kernel takes one head width), which keeps its own scaled q and k^T copies (v as
                 it is) and the probabilities e*n*s*s*b/t (with attention dropout also mask and result)
--recompute-modules core_attn drops `kernel` (its checkpoint keeps q, k, v); mla_up_proj frees the q,
k, v kept as they are (refilled in backward) and keeps the up projections' inputs: under SP that
holds the gathered [s, b, kl + pe] too.
"""

from __future__ import annotations

from megafab.plan.state_memory import BYTES


def mla_attention_bytes(cfg, kernels: str, recompute_core_attention: bool, recompute_up_proj: bool) -> float:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    s, b = m.seq_length // p.context_parallel_size, t.micro_batch_size
    n, qk, pe, v = m.num_attention_heads, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    ql, kl = m.q_lora_rank or 0, m.kv_lora_rank
    tp = p.tensor_model_parallel_size
    sp = p.sequence_parallel and tp > 1
    r = tp if sp else 1
    e = BYTES[cfg.precision.params_dtype_name]
    latents = e * s * b * ((ql + kl) / tp if sp else ql + kl + pe)
    if m.qk_layernorm:
        stats = max(e, 4) * s * b * ((1 if ql else 0) + 1)
        latents += (e * s * b * (ql + kl) + stats) / r
    direct = e * s * b * n * (2 * (qk + pe) + v) / tp  # q, k, v as the up projections made them
    probs, dropout = n * s * s * b / tp, m.attention_dropout > 0
    if recompute_core_attention:
        kernel = 0.0
    elif kernels == "cpu":  # the math kernel copies q and k; v stays as it is
        direct = e * s * b * n * v / tp
        kernel = e * s * b * n * 2 * (qk + pe) / tp + probs * e * (3 if dropout else 1)
    elif kernels == "unfused":
        kernel = probs * (e + ((1 + e) if dropout else 0))
    else:
        kernel = (e * s * b * n * v + 4 * n * s * b) / tp
    if recompute_up_proj:
        direct = 0.0
        if sp:
            latents += e * s * b * (kl + pe)
    return latents + direct + kernel + e * s * b * n * v / tp  # + the projection's input
