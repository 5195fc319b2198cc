"""Attention with a sliding window and attention sinks, the math every layout shares.

Window (megatron-core / Transformer Engine's (left, right) convention, right = 0 here): the query at
position i sees the keys at positions j with i - left <= j <= i, left + 1 keys (left < 0: unbounded).
Masks are built from the tokens' absolute positions, so the same rule holds for a training sequence,
a context-parallel rank's chunks and a KV-cache step whose queries are the last of the keys.

Sink (megatron-core's softmax_type off-by-one / learnable): one more logit per head in the softmax's
denominator with a zero value, p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k)) (off-by-one: sink 0).
Given plain attention's output `out` and log-sum-exp `lse` the sink rescales it exactly,

    lse' = log(exp(lse) + exp(sink)),   out' = out * exp(lse - lse') = out * sigmoid(lse - sink),

and a flash backward run from (out', lse') is the sink attention's backward: the sink acts as one
more key whose value is zero (apply_sink, sink_grad; sink_attention keeps flash's saved set). Shapes:
q [b, heads, sq, d], k and v [b, groups, sk, d] (GQA: query head = group * hpg + j), sink [heads].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megafab.distributed.blockwise_attention import (  # window_mask: there, as its tiles use it
    BlockDropout,
    ReferenceKernel,
    compute_dtype,
    window_mask,
)
from megafab.distributed.fused_attention import block_kernel


def bottom_right_positions(sq: int, sk: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(query, key) positions when the sq queries are the last sq of the sk keys (a KV-cache step,
    or sq == sk: a whole sequence), as megatron-core's get_sliding_window_causal_mask aligns them."""
    keys = torch.arange(sk, device=device)
    return keys[sk - sq:], keys


def attention(q, k, v, masked: torch.Tensor | None, sink: torch.Tensor | None = None,
              dropout_p: float = 0.0, scale: float | None = None, layer_scale: int | None = None
              ) -> torch.Tensor:
    """softmax(q k^T * scale, masked out, with the sink's logit) v -> [b, heads, sq, d]. masked:
    bool broadcastable to [b, heads, sq, sk], True = not allowed (None: causal, bottom-right).
    Without a sink SDPA runs (its kernels form the scores in fp32); with one the probabilities are
    formed explicitly (as megatron-core's local DotProductAttention does), the softmax in fp32 for
    16-bit inputs, and layer_scale (--apply-query-key-layer-scaling: the layer number) divides the
    16-bit scores and multiplies them back in fp32, megatron-core's guard against fp16 overflow."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if sink is None:
        if masked is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                                  **gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~masked, dropout_p=dropout_p, scale=scale,
                                              **gqa)
    b, heads, sq, d = q.shape
    groups, sk = k.shape[1], k.shape[2]
    if masked is None:
        masked = window_mask(*bottom_right_positions(sq, sk, q.device), None)
    scale = (d ** -0.5 if scale is None else scale) / (layer_scale or 1)
    qg = q.reshape(b * groups, heads // groups * sq, d)  # [b g, hpg sq, d]
    # scaled inside the GEMM (megatron-core's baddbmm): the 16-bit scores are formed already scaled;
    # beta 0 ignores the added term, so a 0-d zero stands for it (no scores-sized buffer)
    scores = torch.baddbmm(qg.new_zeros(()), qg, k.reshape(b * groups, sk, d).mT,
                           beta=0.0, alpha=scale).view(b, heads, sq, sk)
    acc = compute_dtype(q.dtype)
    scores = (scores.to(acc) * (layer_scale or 1)).masked_fill(masked, float("-inf"))
    logits = torch.cat([scores, sink.to(acc).view(1, heads, 1, 1).expand(b, heads, sq, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p, training=True)
    out = torch.matmul(probs.unflatten(1, (groups, heads // groups)), v.unsqueeze(2))  # [b, g, hpg, sq, d]
    return out.flatten(1, 2)


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> None:
    """In place: plain attention's out [b, heads, s, d] and lse [b, heads, s] -> the sink's out', lse'
    (module docstring)."""
    new = torch.logaddexp(lse, sink.to(lse.dtype)[None, :, None])
    out.mul_(torch.exp(lse - new)[..., None])
    lse.copy_(new)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """d loss / d sink [heads] from the sink attention's dout, out' and lse': the sink's probability
    times its (zero) value's dp minus delta = rowsum(dout * out'), summed over batch and rows."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [b, heads, s], in lse's fp32 / fp64
    return -(torch.exp(sink.to(lse.dtype)[None, :, None] - lse) * delta).sum((0, 2)).to(sink.dtype)


class _SinkAttention(torch.autograd.Function):
    """Causal attention of a whole sequence with a sink (and a window): one block on the fused kernel
    (the reference kernel for a window or dropout), rescaled by the sink; saves q, k, v, out', lse'."""

    @staticmethod
    def forward(ctx, q, k, v, sink, window, dropout_p: float, seed: int, scale: float):
        if window is None and dropout_p == 0:
            ctx.kernel = block_kernel(q)
        else:
            ctx.kernel = ReferenceKernel(BlockDropout(dropout_p, seed) if dropout_p > 0 else None, window)
        out, lse, ctx.aux = ctx.kernel.forward(q, k, v, True, scale)
        apply_sink(out, lse, sink.detach())
        ctx.scale, out = scale, out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, True, ctx.scale, 0, ctx.aux)
        dsink = sink_grad(dout, out, lse, sink) if ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None, None, None, None


def sink_attention(q, k, v, sink: torch.Tensor, window: int | None = None, dropout_p: float = 0.0,
                   seed: int = 0, scale: float | None = None) -> torch.Tensor:
    """attention(q, k, v, window_mask(window), sink) of a whole causal sequence (sq == sk) without
    its [sq, sk] probabilities: what flash attention saves, tiles of query rows transient. Dropout
    masks come from `seed` (blockwise_attention.BlockDropout)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _SinkAttention.apply(q, k, v, sink, window, dropout_p, seed, scale)
