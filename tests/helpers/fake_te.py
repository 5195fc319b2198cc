"""A plain-torch stand-in for transformer_engine (test-only): Linear, LayerNormLinear,
DotProductAttention and fp8_autocast with the keyword names of TE's documented constructors (an
unknown keyword is a TypeError, as with TE), single-process math. `install(monkeypatch)` puts it
in sys.modules and returns the record of every module built (class name, args, kwargs)."""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.nn.functional as F


def _shape(n_in, n_out, parallel_mode, tp_size):
    if parallel_mode == "column":
        return n_out // tp_size, n_in
    if parallel_mode == "row":
        return n_out, n_in // tp_size
    assert parallel_mode is None, parallel_mode
    return n_out, n_in


def build(record: list) -> dict:
    class Linear(torch.nn.Module):
        def __init__(self, in_features, out_features, bias=True, init_method=None, params_dtype=None,
                     parallel_mode=None, tp_group=None, tp_size=1, sequence_parallel=False,
                     get_rng_state_tracker=None, device="cuda", return_bias=False,
                     fuse_wgrad_accumulation=False, rng_tracker_name=None, ub_name=None):
            super().__init__()
            record.append(("Linear", (in_features, out_features),
                           dict(parallel_mode=parallel_mode, tp_size=tp_size)))
            out_rows, in_cols = _shape(in_features, out_features, parallel_mode, tp_size)
            self.weight = torch.nn.Parameter(torch.zeros(out_rows, in_cols, dtype=params_dtype))
            self.bias = torch.nn.Parameter(torch.zeros(out_rows if parallel_mode != "row" else out_features,
                                                       dtype=params_dtype)) if bias else None

        def forward(self, x):
            return F.linear(x, self.weight, self.bias)

    class LayerNormLinear(Linear):
        def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False,
                     fuse_wgrad_accumulation=False, tp_group=None, tp_size=1, get_rng_state_tracker=None,
                     init_method=None, bias=True,
                     normalization="LayerNorm", return_bias=False, params_dtype=None, parallel_mode=None,
                     return_layernorm_output=False, zero_centered_gamma=False, device="cuda"):
            super().__init__(in_features, out_features, bias=bias, params_dtype=params_dtype,
                             parallel_mode=parallel_mode, tp_group=tp_group, tp_size=tp_size,
                             sequence_parallel=sequence_parallel)
            record[-1] = ("LayerNormLinear", (in_features, out_features), record[-1][2])
            self.eps, self.rms, self.zero_centered = eps, normalization == "RMSNorm", zero_centered_gamma
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(in_features, dtype=params_dtype))
            if not self.rms:
                self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features, dtype=params_dtype))

        def forward(self, x):
            w = self.layer_norm_weight + 1 if self.zero_centered else self.layer_norm_weight
            if self.rms:
                h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w
            else:
                h = F.layer_norm(x, x.shape[-1:], w, self.layer_norm_bias, self.eps)
            return F.linear(h, self.weight, self.bias)

    class DotProductAttention(torch.nn.Module):
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                     qkv_format="sbhd", attn_mask_type="causal", window_size=None, sequence_parallel=False,
                     tp_size=1, get_rng_state_tracker=None, tp_group=None, layer_number=None,
                     attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                     cp_comm_type="p2p", softmax_scale=None):
            super().__init__()
            record.append(("DotProductAttention", (num_attention_heads, kv_channels),
                           dict(num_gqa_groups=num_gqa_groups, softmax_scale=softmax_scale)))
            assert qkv_format == "sbhd" and attn_mask_type == "causal"
            self.scale = softmax_scale

        def forward(self, query_layer, key_layer, value_layer, attention_mask=None, attn_mask_type=None):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))  # bhsd
            if attention_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                     enable_gqa=q.shape[1] != k.shape[1])
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.scale,
                                                     enable_gqa=q.shape[1] != k.shape[1])
            return out.permute(2, 0, 1, 3).flatten(2)

    def moe_permute_with_probs(inp, probs, routing_map, num_out_tokens=-1):
        record.append(("moe_permute", (num_out_tokens,), {}))
        expert_major = routing_map.t()
        token_ids = torch.arange(routing_map.shape[0]).expand_as(expert_major).masked_select(expert_major)
        return inp.index_select(0, token_ids), probs.t().masked_select(expert_major), token_ids

    def moe_permute(inp, routing_map, num_out_tokens=-1, max_token_num=-1, map_type="mask"):
        rows, _, token_ids = moe_permute_with_probs(inp, routing_map.to(inp.dtype), routing_map,
                                                    num_out_tokens)
        return rows, token_ids

    def moe_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask", probs=None):
        assert merging_probs is None and map_type == "mask"
        return torch.zeros(restore_shape, dtype=inp.dtype).index_add(0, row_id_map, inp)

    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.moe_permute, pytorch.moe_permute_with_probs = moe_permute, moe_permute_with_probs
    pytorch.moe_unpermute = moe_unpermute
    pytorch.Linear, pytorch.LayerNormLinear = Linear, LayerNormLinear
    pytorch.DotProductAttention = DotProductAttention
    pytorch.fp8_autocast = lambda **kwargs: contextlib.nullcontext()
    recipe = types.ModuleType("transformer_engine.common.recipe")
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    package = types.ModuleType("transformer_engine")
    package.pytorch, package.common = pytorch, common
    return {"transformer_engine": package, "transformer_engine.pytorch": pytorch,
            "transformer_engine.common": common, "transformer_engine.common.recipe": recipe}


def install(monkeypatch) -> list:
    record: list = []
    for name, module in build(record).items():
        monkeypatch.setitem(sys.modules, name, module)
    return record
