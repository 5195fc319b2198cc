"""A plain-torch stand-in for transformer_engine (test-only): Linear, LayerNormLinear,
DotProductAttention, fp8_autocast, checkpoint and distributed.activation_recompute_forward with the
keyword names of TE's documented API (an unknown keyword is a TypeError, as with TE), plain math.
DotProductAttention with a cp_group is TE's context parallelism as documented: this rank's queries
are chunks r and 2cp-1-r of 2*cp, attending causally over the whole sequence (keys gathered here).
FP8 state as TE keeps it: a module runs in FP8 inside fp8_autocast, or in a checkpoint's recompute
phase when its forward did (recorded per call in `record` as ("fp8", module, on)). FP8 weights
(quantized_model_init, tensor.utils): fake_te_fp8.py.
`install(monkeypatch)` puts it in sys.modules and returns the record (class name, args, kwargs)."""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import fake_te_fp8


def _shape(n_in, n_out, parallel_mode, tp_size):
    if parallel_mode == "column":
        return n_out // tp_size, n_in
    if parallel_mode == "row":
        return n_out, n_in // tp_size
    assert parallel_mode is None, parallel_mode
    return n_out, n_in


class _GatherSequence(torch.autograd.Function):
    """[s_local, ...] of every rank of `group` -> [cp * s_local, ...] in rank order; backward: the
    sum of every rank's gradient for this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[ctx.rank], None


def _cp_positions(s_local, rank, cp):
    c = s_local // 2
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in (rank, 2 * cp - 1 - rank)])


def build(record: list) -> dict:
    fp8 = {"autocast": 0, "recompute": 0, "forward_fp8": []}

    def note_fp8(module):
        on = fp8["autocast"] > 0 or (fp8["recompute"] > 0 and getattr(module, "fp8_in_forward", False))
        module.fp8_in_forward = on
        record.append(("fp8", type(module).__name__, on))

    class Linear(torch.nn.Module):
        def __init__(self, in_features, out_features, bias=True, init_method=None, params_dtype=None,
                     parallel_mode=None, tp_group=None, tp_size=1, sequence_parallel=False,
                     get_rng_state_tracker=None, device="cuda", return_bias=False,
                     fuse_wgrad_accumulation=False, rng_tracker_name=None, ub_name=None):
            super().__init__()
            record.append(("Linear", (in_features, out_features),
                           dict(parallel_mode=parallel_mode, tp_size=tp_size)))
            out_rows, in_cols = _shape(in_features, out_features, parallel_mode, tp_size)
            self.weight = fake_te_fp8.weight((out_rows, in_cols), params_dtype)  # FP8 in quantized init
            self.bias = torch.nn.Parameter(torch.zeros(out_rows if parallel_mode != "row" else out_features,
                                                       dtype=params_dtype)) if bias else None

        def forward(self, x):
            note_fp8(self)
            fake_te_fp8.usable(self.weight)
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
            note_fp8(self)
            fake_te_fp8.usable(self.weight)
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
            assert cp_comm_type in ("p2p", "all_gather", "a2a", "a2a+p2p"), cp_comm_type
            self.scale, self.cp_group = softmax_scale, cp_group
            if cp_group is not None:
                assert cp_global_ranks == dist.get_process_group_ranks(cp_group)
                record.append(("cp", (dist.get_world_size(cp_group),), dict(cp_comm_type=cp_comm_type)))

        def forward(self, query_layer, key_layer, value_layer, attention_mask=None, attn_mask_type=None):
            note_fp8(self)
            if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
                assert attention_mask is None, "TE's context parallelism takes no arbitrary mask"
                return self._context_parallel(query_layer, key_layer, value_layer)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))  # bhsd
            if attention_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                     enable_gqa=q.shape[1] != k.shape[1])
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.scale,
                                                     enable_gqa=q.shape[1] != k.shape[1])
            return out.permute(2, 0, 1, 3).flatten(2)

        def _context_parallel(self, q, k, v):
            cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
            s = q.shape[0]
            k, v = (_GatherSequence.apply(t, self.cp_group) for t in (k, v))  # [cp * s, b, g, d]
            key_positions = torch.cat([_cp_positions(s, r, cp) for r in range(cp)])
            hidden = key_positions[None, :] > _cp_positions(s, rank, cp)[:, None]  # [s, cp * s]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden, scale=self.scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            return out.permute(2, 0, 1, 3).flatten(2)

    @contextlib.contextmanager
    def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
        record.append(("fp8_autocast", (), dict(enabled=enabled, fp8_group=fp8_group)))
        fp8["autocast"] += enabled
        try:
            yield
        finally:
            fp8["autocast"] -= enabled

    @contextlib.contextmanager
    def activation_recompute_forward(activation_recompute=False, recompute_phase=False):
        fp8["recompute"] += recompute_phase
        try:
            yield
        finally:
            fp8["recompute"] -= recompute_phase

    def checkpoint(function, *args, distribute_saved_activations=False, get_rng_state_tracker=None,
                   tp_group=None, use_reentrant=True, context_fn=None, **kwargs):
        record.append(("checkpoint", (), dict(use_reentrant=use_reentrant, tp_group=tp_group,
                                              distributed=distribute_saved_activations)))
        assert get_rng_state_tracker is None or callable(get_rng_state_tracker().get_states)
        function.fsdp_wrapped, function.fsdp_group = False, None  # as TE does (fails on a bound method)
        user_forward, user_recompute = context_fn()

        @contextlib.contextmanager
        def recompute():
            with activation_recompute_forward(True, True), user_recompute:
                yield

        def contexts():
            return user_forward, recompute()
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant,
                                                 context_fn=contexts, **kwargs)

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
    pytorch.fp8_autocast, pytorch.checkpoint = fp8_autocast, checkpoint
    pytorch.quantized_model_init = fake_te_fp8.quantized_model_init  # fp8_model_init before TE 2.9
    tensor = types.ModuleType("transformer_engine.pytorch.tensor")
    tensor.QuantizedTensor = tensor.Float8Tensor = fake_te_fp8.Float8Tensor
    utils = types.ModuleType("transformer_engine.pytorch.tensor.utils")
    for name in ("replace_raw_data", "cast_master_weights_to_fp8", "post_all_gather_processing"):
        setattr(utils, name, getattr(fake_te_fp8, name))
    tensor.utils, pytorch.tensor = utils, tensor
    distributed = types.ModuleType("transformer_engine.pytorch.distributed")
    distributed.activation_recompute_forward = activation_recompute_forward
    distributed.checkpoint = checkpoint
    pytorch.distributed = distributed
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")
    recipe.DelayedScaling = lambda **kwargs: ("DelayedScaling", kwargs)
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    package = types.ModuleType("transformer_engine")
    package.pytorch, package.common = pytorch, common
    return {"transformer_engine": package, "transformer_engine.pytorch": pytorch,
            "transformer_engine.pytorch.distributed": distributed,
            "transformer_engine.pytorch.tensor": tensor, "transformer_engine.pytorch.tensor.utils": utils,
            "transformer_engine.common": common, "transformer_engine.common.recipe": recipe}


def te_name(name: str, moe_layers: set[str]) -> str:
    """megatron-core's TE-spec name of a local parameter of an MLA model's layers around TE's modules
    (the tests' expectation, written out): the latent norms and a dense pre-MLP norm fused into the
    next TE linear, an MoE layer's (`moe_layers`: their name prefixes) kept."""
    fused = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
             "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
    for local, te in fused.items():
        if local in name:
            return name.replace(local, te)
    if "pre_mlp_layernorm." in name and not any(name.startswith(p) for p in moe_layers):
        return name.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
    return name


def install(monkeypatch) -> list:
    record: list = []
    for name, module in build(record).items():
        monkeypatch.setitem(sys.modules, name, module)
    return record
