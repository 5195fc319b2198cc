"""self_attention.core_attention: softmax(q k^T / sqrt(d)) v with megatron-core's sliding window
(--window-size, per layer by --window-attn-skip-freq) and attention sinks (--softmax-type), the
math in distributed/masked_attention.py, context parallelism in distributed/context_parallel.py.

Which layers are windowed is megatron-core's is_layer_window_attention with its 1-based layer
numbers: freq N windows every layer but N, 2N, ...; a pattern windows layer n (1-based) where its
n-th entry is 1. A learnable sink is one logit per head, `core_attention.softmax_offset` [heads/tp]
(megatron-core's name), drawn normal(0, --init-method-std) as megatron-core's init_method draws it
(the full [heads] tensor from its name's seed, each TP rank keeping its heads). A whole sequence
with sinks runs masked_attention.sink_attention (flash's saved set, no [s, s] probabilities);
document masks and KV-cache steps the explicit softmax, windows without sinks SDPA with the mask.

Megatron's local DotProductAttention replaces the --reset-attention-mask document mask by the
window mask on windowed layers; here the two combine (a key must be in the same document and in the
window), as Transformer Engine's padding-causal masks with a window do.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megafab.distributed.context_parallel import context_parallel_attention
from megafab.distributed.layers import partition_of
from megafab.distributed.mappings import group_rank, group_size
from megafab.distributed.masked_attention import (
    attention,
    bottom_right_positions,
    sink_attention,
    window_mask,
)
from megafab.distributed.random import host_seed
from megafab.model.attention_backend import sdpa_context
from megafab.model.init import normal_init

SOFTMAX_OFFSET = "core_attention.softmax_offset"  # under a layer's self_attention.


def is_window_layer(m, layer_number: int) -> bool:
    """Whether global layer `layer_number` (0-based) attends through --window-size's window."""
    if not m.window_size or m.window_size[0] < 0:
        return False
    freq = m.window_attn_skip_freq
    if freq is None:
        return True
    if isinstance(freq, int):
        return (layer_number + 1) % freq != 0
    return bool(freq[layer_number])


def window_attention_problems(m, p) -> list[str]:
    """The rules of --window-size, --window-attn-skip-freq and --softmax-type (one line each)."""
    out = []
    size = m.window_size
    if size is not None and (len(size) != 2 or size[1] != 0 or size[0] < -1):
        out.append(f"--window-size {m.window_size}: give (left, 0) with left >= 0 (-1: no window); GPT "
                   f"attention is causal, so the right side must be 0")
    freq = m.window_attn_skip_freq
    if freq is not None and m.window_size is None:
        out.append("--window-attn-skip-freq needs --window-size (it chooses which layers are windowed)")
    if isinstance(freq, int) and freq < 1:
        out.append(f"--window-attn-skip-freq {freq} must be at least 1")
    if isinstance(freq, (tuple, list)) and m.num_layers and len(freq) != m.num_layers:
        out.append(f"--window-attn-skip-freq pattern has {len(freq)} entries for --num-layers "
                   f"{m.num_layers}; give one 0/1 per layer")
    windowed = m.window_size is not None and m.window_size[0] >= 0
    sinks = m.softmax_type != "vanilla"
    for flag, on in (("--window-size", windowed), ("--softmax-type " + m.softmax_type, sinks)):
        if not on:
            continue
        if m.multi_latent_attention:
            out.append(f"{flag} with --multi-latent-attention is not implemented in megafab yet; drop one")
        if m.mtp_num_layers:
            out.append(f"{flag} with --mtp-num-layers is not implemented in megafab yet (megatron-core "
                       f"numbers MTP layers past --num-layers); drop one")
    if windowed and p.context_parallel_size > 1 and p.cp_comm_type == "p2p":
        out.append(f"--window-size with --context-parallel-size {p.context_parallel_size} and --cp-comm-type "
                   f"p2p: megafab's K/V ring has causal or full blocks, not banded ones; use --cp-comm-type "
                   f"allgather or a2a")
    return out


class CoreAttention(nn.Module):
    """q [b, heads/tp, s, d], k/v [b, groups/tp, s, d] -> [b, heads/tp, s, d]; called as
    core_attention(q, k, v, attention_mask, dropout), what selective recompute (core_attn) recomputes.
    attention_mask: True where NOT allowed, [b|1, 1, sq, sk]; the queries are the last sq keys (under
    context parallelism the whole sequence's [b|1, 1, s, s], in sequence order)."""

    def __init__(self, cfg, ctx, prefix: str, layer_number: int):
        super().__init__()
        self.ctx = ctx
        self.sdpa_backend = sdpa_context(cfg.attention_backend)
        self.window = cfg.window_size[0] if is_window_layer(cfg, layer_number) else None
        self.softmax_type = cfg.softmax_type
        self.layer_scale = layer_number + 1 if cfg.apply_query_key_layer_scaling else None  # mcore: 1-based
        heads, tp = cfg.num_attention_heads, group_size(ctx.tp_group)
        self.heads_local = heads // tp
        if cfg.softmax_type == "learnable":
            full = torch.empty(heads, dtype=torch.float64)
            normal_init(ctx.seed, prefix + SOFTMAX_OFFSET, cfg.init_method_std)(full)
            shard = partition_of(full, 0, group_rank(ctx.tp_group), tp)
            self.softmax_offset = nn.Parameter(shard.to(device=ctx.device, dtype=ctx.params_dtype))
            self.softmax_offset.tensor_model_parallel = True
            self.softmax_offset.partition_dim, self.softmax_offset.partition_stride = 0, 1
        else:
            self.softmax_offset = None

    def sink(self, q: torch.Tensor) -> torch.Tensor | None:
        if self.softmax_type == "off-by-one":
            return q.new_zeros(self.heads_local)
        return self.softmax_offset

    def forward(self, q, k, v, attention_mask, dropout):
        sink = self.sink(q)
        with self.ctx.tp_region_rng() if dropout > 0 else contextlib.nullcontext(), self.sdpa_backend():
            if self.ctx.cp_group is not None:  # a mask here is the whole sequence's
                seed = host_seed(self.ctx.rng_tracker) if dropout > 0 else None
                return context_parallel_attention(q, k, v, self.ctx.cp_group, self.ctx.cp_comm_type, dropout,
                                                  seed, window=self.window, sink=sink, mask=attention_mask)
            if sink is not None and attention_mask is None and q.shape[2] == k.shape[2]:
                # a whole causal sequence: flash's saved set, not the [s, s] probabilities
                seed = host_seed(self.ctx.rng_tracker) if dropout > 0 else 0
                return sink_attention(q, k, v, sink, self.window, dropout, seed)
            masked = attention_mask
            if self.window is not None:
                local = window_mask(*bottom_right_positions(q.shape[2], k.shape[2], q.device), self.window)
                masked = local if masked is None else masked | local
            return attention(q, k, v, masked, sink, dropout, layer_scale=self.layer_scale)

    def extra_repr(self) -> str:
        return f"window={self.window}, softmax_type={self.softmax_type}"
