"""gpt-oss (transformers' GptOssForCausalLM) <-> megafab. Attention: Llama's names (hf_llama.py) with
q/k/v/o biases (attention_bias = --add-bias-linear; false imports as --disable-bias-linear when the
experts' and router's biases are all zero), self_attn.sinks = core_attention.softmax_offset
(--softmax-type learnable), head_dim = --kv-channels, GQA. layer_types' sliding_attention layers
attend through sliding_window W = --window-size (W-1, 0), chosen by the --window-attn-skip-freq 0/1
pattern (1: sliding). RoPE: rope_type yarn is --position-embedding-type yarn (hf_rope_yarn.py's
values; mscale 1 and mscale_all_dim 0 are HF's yarn_mscale(factor) and are not written), default /
llama3 / linear as Llama's. Every layer is MoE: mlp.router.weight / bias = router.weight / bias
(top-k of the logits, softmax over the k: hf_moe.router_settings); mlp.experts.gate_up_proj [E, h, 2f]
holds gate and up in INTERLEAVED columns (gate = [..., ::2], up = [..., 1::2]), megafab's fc1
[E, 2f, h] = [gate; up] rows; down_proj [E, f, h] is fc2 [E, h, f] transposed ([in, out] vs
[out, in]); their biases are fc1's (same interleave) and fc2's. The experts' clamped GLU is
--quick-geglu (alpha 1.702) with --activation-func-clamp-value swiglu_limit and --glu-linear-offset 1
(up + 1). megafab routes in fp32 (--moe-router-dtype fp32), transformers in the model's dtype.
"""

from __future__ import annotations

import dataclasses

import torch

from megafab.config import ModelConfig
from megafab.convert import hf_llama, hf_mistral, hf_moe, hf_rope_yarn
from megafab.convert.state_dict import ConversionError, check_keys, expected_keys, plain_norm_weights
from megafab.model.activations import QUICK_GELU_ALPHA
from megafab.model.core_attention import SOFTMAX_OFFSET, is_window_layer
from megafab.model.rotary import rope_kind
from megafab.param_names import EXPERTS, ROUTER, layer_prefix
from megafab.progress import progress

NAME = "gpt-oss"
HF_LAYERS = hf_llama.HF_LAYERS
DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta: rope_theta when config.json has none
GLU_OFFSET = 1.0  # HF's (up + 1)
SLIDING, FULL = "sliding_attention", "full_attention"
_BIASES = {"self_attn.o_proj.bias": "self_attention.linear_proj.bias"}
_ALWAYS = {"self_attn.sinks": "self_attention." + SOFTMAX_OFFSET, "mlp.router.weight": ROUTER + "weight"}
_ROUTER_BIAS = ("mlp.router.bias", ROUTER + "bias")
_HF_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
               "mlp.experts.down_proj_bias")
_FC = tuple(EXPERTS + n for n in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight",
                                  "linear_fc2.bias"))


def _attention_view(m: ModelConfig) -> ModelConfig:
    """`m` as hf_llama's attention sees it: q/k/v biases wherever megatron-core has them."""
    return dataclasses.replace(m, add_qkv_bias=m.add_qkv_bias or m.add_bias_linear)


def export_problems(m: ModelConfig, moe) -> list[str]:
    out = [p for p in hf_moe.export_problems(m, moe, NAME) if not p.startswith("--add-bias-linear")]
    out += [p for p in hf_llama.hf_variant_problems(m, NAME)
            if not p.startswith(("--window-size", "--softmax-type"))]
    wants = (("--softmax-type", m.softmax_type, "learnable"), ("--quick-geglu", m.quick_geglu, True),
             ("--swiglu", m.swiglu, False), ("--glu-linear-offset", m.glu_linear_offset, GLU_OFFSET),
             ("--normalization", m.normalization, "RMSNorm"),
             ("--moe-router-pre-softmax", moe.moe_router_pre_softmax, False))
    out += [f"{flag} {have} (HF {NAME} has {want})" for flag, have, want in wants if have != want]
    if m.activation_func_clamp_value is None:
        out.append(f"no --activation-func-clamp-value (HF {NAME} always clamps at swiglu_limit)")
    if m.add_qkv_bias and not m.add_bias_linear:
        out.append(f"--add-qkv-bias with --disable-bias-linear (HF {NAME}'s attention_bias puts biases on "
                   f"q, k, v and o together)")
    if any(not moe.is_moe_layer(i) for i in range(m.num_layers)):
        out.append(f"--moe-layer-freq {moe.moe_layer_freq} (every HF {NAME} layer is MoE)")
    kind = rope_kind(m)
    if kind is None:
        out.append(f"--position-embedding-type {m.position_embedding_type} (HF {NAME} uses RoPE)")
    elif kind == "yarn":
        out += hf_rope_yarn.export_problems(m)
    elif m.rotary_percent != 1.0:
        out.append(f"--rotary-percent {m.rotary_percent} (HF {NAME} rotates every channel)")
    return out


def check_exportable(m: ModelConfig, moe) -> None:
    problems = export_problems(m, moe)
    if problems:
        raise ConversionError(f"HF {NAME} cannot express {'; '.join(problems)}; this model cannot be "
                              f"exported as {NAME}")


def _rope_to_hf(m: ModelConfig) -> dict:
    if rope_kind(m) != "yarn":
        return hf_llama.rope_to_hf(m)
    rope = hf_rope_yarn.to_hf(m)
    if rope["mscale"] == 1.0 and not rope["mscale_all_dim"]:  # HF's default: yarn_mscale(factor)
        del rope["mscale"], rope["mscale_all_dim"]
    return rope


def to_hf_config(m: ModelConfig, moe, eod: int | None = None, bos: int | None = None):
    """The transformers GptOssConfig of megafab model config `m` and MoE settings `moe`."""
    from transformers import GptOssConfig

    check_exportable(m, moe)
    window = hf_mistral.window_of(m)
    types = [SLIDING if is_window_layer(m, i) else FULL for i in range(m.num_layers)]
    return GptOssConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=moe.ffn_hidden_size(m.ffn_hidden_size), num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups,
        head_dim=m.kv_channels, num_local_experts=moe.num_experts, num_experts_per_tok=moe.moe_router_topk,
        layer_types=types,
        **({"sliding_window": window} if window is not None else {}),
        max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.norm_epsilon,
        rope_parameters=_rope_to_hf(m), attention_bias=m.add_bias_linear,
        attention_dropout=m.attention_dropout, swiglu_limit=float(m.activation_func_clamp_value),
        router_aux_loss_coef=moe.aux_loss_coeff("aux_loss"),
        initializer_range=m.init_method_std, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        bos_token_id=bos, eos_token_id=eod, architectures=["GptOssForCausalLM"])


def _refuse(field: str, value, rule: str) -> None:
    raise ConversionError(f"config.json {field} {value!r}: {rule}; megafab cannot import this model exactly")


def _rope_from_hf(c: dict) -> dict:
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    c = {**c, "rope_theta": c.get("rope_theta", DEFAULT_THETA)}
    if (rope.get("rope_type") or rope.get("type")) == "yarn":
        out = hf_rope_yarn.from_hf(c)
        del out["rope_type"]  # multi-latent attention's --rope-type; standard attention's is below
        return {**out, "position_embedding_type": "yarn"}
    return {**hf_llama.rope_from_hf(c), "position_embedding_type": "rope"}


def _window_from_hf(c: dict) -> dict:
    """--window-size and --window-attn-skip-freq of config.json's sliding_window and layer_types."""
    layers = c["num_hidden_layers"]
    types = c.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if len(types) != layers or set(types) - {SLIDING, FULL}:
        _refuse("layer_types", types, f"give one of {SLIDING!r} / {FULL!r} per layer ({layers} layers)")
    window = c.get("sliding_window")
    pattern = tuple(int(t == SLIDING) for t in types)
    if window is None or not any(pattern):
        return {}
    if window < 1:
        _refuse("sliding_window", window, "a window holds at least the query")
    return dict(window_size=(window - 1, 0), window_attn_skip_freq=None if all(pattern) else pattern)


def from_hf_config(c: dict) -> dict:
    """Flat megafab fields (model and cfg.moe) from a gpt-oss config.json dict; one ConversionError
    naming the field for any value megafab does not reproduce exactly."""
    limit, alpha = c.get("swiglu_limit", 7.0), c.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if c.get("quantization_config") is not None:
        _refuse("quantization_config", c["quantization_config"].get("quant_method"),
                "megafab imports unquantized weights (openai's release stores MXFP4 experts); "
                "save_pretrained a dequantized copy (transformers' Mxfp4Config(dequantize=True)) and "
                "import that")
    if alpha != QUICK_GELU_ALPHA:
        _refuse("swiglu_alpha", alpha, f"megafab's --quick-geglu gate is x * sigmoid({QUICK_GELU_ALPHA} x)")
    if limit is None or not 0 < limit < float("inf"):
        _refuse("swiglu_limit", limit, "megafab's --activation-func-clamp-value is finite and above zero")
    base = {k: v for k, v in c.items() if k not in ("rope_parameters", "rope_scaling")}
    flat = hf_llama.from_hf_config({**base, "hidden_act": "silu", "attention_bias": False})
    flat.pop("rotary_base")
    flat.update(**_rope_from_hf(c), **_window_from_hf(c), swiglu=False, quick_geglu=True,
                activation_func_clamp_value=float(limit), glu_linear_offset=GLU_OFFSET,
                add_bias_linear=bool(c.get("attention_bias", True)), softmax_type="learnable",
                num_experts=c["num_local_experts"],
                moe_router_topk=c["num_experts_per_tok"], moe_ffn_hidden_size=c["intermediate_size"],
                moe_layer_freq=1, moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=c.get("router_aux_loss_coef", 0.0), moe_token_dispatcher_type="alltoall",
                **hf_moe.router_settings(norm_topk_prob=True))
    return flat


def _layer_map(m: ModelConfig) -> dict:
    """HF name -> megafab name of one layer's 1:1 tensors besides Llama's attention (layer-relative)."""
    return {**_ALWAYS, **(dict([_ROUTER_BIAS], **_BIASES) if m.add_bias_linear else {})}


def _interleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """[gate; up] halves along `dim` -> HF's columns gate_0, up_0, gate_1, up_1, ..."""
    gate, up = gate_up.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _deinterleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of _interleave."""
    index = torch.arange(gate_up.shape[dim])
    return torch.cat([gate_up.index_select(dim, index[::2]), gate_up.index_select(dim, index[1::2])], dim=dim)


def _experts_to_hf(sd: dict, src: str, dst: str, m: ModelConfig) -> dict:
    fc1 = sd[src + _FC[0]]  # [E, 2f, h]
    fc2 = sd[src + _FC[2]]  # [E, h, f]
    zeros = (fc1.new_zeros(fc1.shape[:2]), fc2.new_zeros(fc2.shape[:2]))
    fc1_bias, fc2_bias = (sd[src + _FC[1]], sd[src + _FC[3]]) if m.add_bias_linear else zeros
    tensors = (_interleave(fc1, 1).transpose(1, 2), _interleave(fc1_bias, 1), fc2.transpose(1, 2), fc2_bias)
    out = {dst + n: t.contiguous() for n, t in zip(_HF_EXPERTS, tensors)}
    if not m.add_bias_linear:  # --disable-bias-linear: HF's router always has a bias
        out[dst + _ROUTER_BIAS[0]] = fc1.new_zeros(fc1.shape[0])
    return out


def _experts_from_hf(hf: dict, src: str, dst: str, m: ModelConfig) -> dict:
    gate_up, gate_up_bias, down, down_bias = (hf[src + n] for n in _HF_EXPERTS)
    out = {dst + _FC[0]: _deinterleave(gate_up, 2).transpose(1, 2).contiguous(),
           dst + _FC[2]: down.transpose(1, 2).contiguous()}
    if m.add_bias_linear:
        out.update({dst + _FC[1]: _deinterleave(gate_up_bias, 1), dst + _FC[3]: down_bias})
        return out
    for name in (*_HF_EXPERTS[1::2], _ROUTER_BIAS[0]):
        if hf[src + name].any():
            raise ConversionError(f"config.json attention_bias false with a nonzero {src + name}: megafab's "
                                  f"--disable-bias-linear has no expert or router biases, --add-bias-linear "
                                  f"also biases the attention; megafab cannot import this model exactly")
    return out


def hf_expected_keys(m: ModelConfig) -> set[str]:
    keys = hf_llama.hf_base_keys(m)
    names = [*hf_llama.attention_hf_names(_attention_view(m)), *_ALWAYS, _ROUTER_BIAS[0], *_HF_EXPERTS,
             *(_BIASES if m.add_bias_linear else ())]
    for i in range(m.num_layers):
        keys.update(layer_prefix(i, HF_LAYERS) + n for n in names)
    return keys


def to_hf_state_dict(sd: dict[str, torch.Tensor], m: ModelConfig, moe) -> dict[str, torch.Tensor]:
    """Full megafab state dict -> GptOssForCausalLM's (no lm_head when tied)."""
    check_exportable(m, moe)
    check_keys(sd, expected_keys(m, moe), "the megafab state dict")
    sd = plain_norm_weights(sd, m)
    out = hf_llama.base_to_hf(sd, m)
    view = _attention_view(m)
    for i in progress(range(m.num_layers), desc=f"export to HF {NAME}", unit="layer"):
        src, dst = layer_prefix(i), layer_prefix(i, HF_LAYERS)
        out.update(hf_llama.attention_to_hf(sd, src, dst, view))
        out.update({dst + hf: sd[src + mf] for hf, mf in _layer_map(m).items()})
        out.update(_experts_to_hf(sd, src, dst, m))
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], m: ModelConfig, moe) -> dict[str, torch.Tensor]:
    """GptOssForCausalLM's state dict -> full megafab state dict (vocabulary padded)."""
    hf = hf_llama.hf_weights(hf, m)
    check_keys(hf, hf_expected_keys(m), f"the HF {NAME} weights")
    sd = hf_llama.base_from_hf(hf, m)
    view = _attention_view(m)
    for i in progress(range(m.num_layers), desc=f"import from HF {NAME}", unit="layer"):
        src, dst = layer_prefix(i, HF_LAYERS), layer_prefix(i)
        sd.update(hf_llama.attention_from_hf(hf, src, dst, view))
        sd.update({dst + mf: hf[src + name] for name, mf in _layer_map(m).items()})
        sd.update(_experts_from_hf(hf, src, dst, m))
    return sd
