"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM) <-> megafab: multi-latent attention, YaRN, MoE
with sigmoid group-limited routing, the expert correction bias, shared experts and dense first layers.
Attention: q_a_proj / q_a_layernorm / q_b_proj (q_proj without q_lora_rank), kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj are --multi-latent-attention's linear_q_down_proj / q_layernorm /
linear_q_up_proj (linear_q_proj), linear_kv_down_proj, kv_layernorm, linear_kv_up_proj, linear_proj
(--qk-layernorm), same row order. RoPE: megafab rotates the pe channels as pairs (2i, 2i+1), as
transformers' rope_interleave true does; rope_interleave false (rotate-half) is imported by
interleaving each pe block's two halves. YaRN: rope_parameters (hf_rope_yarn.py). Router:
gate.weight / gate.e_score_correction_bias are router.weight / router.expert_bias
(--moe-router-enable-expert-bias); HF scores each group by its top-2 experts, megatron-core by its
top topk/topk_group: equal when that is 2 (or every group is kept). Experts and shared experts
(moe_intermediate_size x n_shared_experts) as hf_moe.py lays them out. Only rms_norm_eps 1e-6
converts (transformers fixes the latent norms' eps at 1e-6).

MTP: an export writes megafab's --mtp-num-layers depth k as DeepSeek's layer num_hidden_layers + k
(enorm, hnorm, eh_proj, shared_head.norm = final_layernorm, a MoE decoder layer, copies of the
embedding and output weight as embed_tokens / shared_head.head; num_nextn_predict_layers), as
DeepSeek ships it for transformers' MtpModel and vLLM. An import leaves those layers out, as
DeepseekV3ForCausalLM does (train MTP afresh with --mtp-num-layers).
"""

from __future__ import annotations

import torch

from megafab.config import ModelConfig
from megafab.convert import hf_llama, hf_moe, hf_rope_yarn
from megafab.convert.state_dict import ConversionError, check_keys, expected_keys
from megafab.param_names import EXPERTS, MTP_LAYERS, MTP_TRANSFORMER_LAYER, ROUTER, layer_prefix, parse_index
from megafab.progress import progress

NAME = "DeepSeek-V3"
HF_LAYERS = hf_llama.HF_LAYERS
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): its default eps
_NORMS = {"input_layernorm.weight": "input_layernorm.weight",
          "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"}
_ATTENTION = {"kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
              "kv_a_layernorm.weight": "kv_layernorm.weight",
              "kv_b_proj.weight": "linear_kv_up_proj.weight", "o_proj.weight": "linear_proj.weight"}
_Q_LORA = {"q_a_proj.weight": "linear_q_down_proj.weight",
           "q_a_layernorm.weight": "q_layernorm.weight", "q_b_proj.weight": "linear_q_up_proj.weight"}
_Q_DIRECT = {"q_proj.weight": "linear_q_proj.weight"}
_ROUTER = {"mlp.gate.weight": ROUTER + "weight",
           "mlp.gate.e_score_correction_bias": ROUTER + "expert_bias"}
_EXPERT_ROOT = "mlp.experts."
_EXPERT_NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
_SHARED = ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
           "mlp.shared_experts.down_proj.weight")
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "final_layernorm.weight"}
KEEP_FP32 = ("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias")  # float32 on both sides
_NORM_SUFFIXES = ("layernorm.weight", "enorm.weight", "hnorm.weight")  # every norm, MLA's and MTP's


def _attention_names(m: ModelConfig) -> dict:
    """HF self_attn.<name> -> megafab self_attention.<name> of one layer."""
    return {**(_Q_DIRECT if m.q_lora_rank is None else _Q_LORA), **_ATTENTION}


def interleave_halves(w: torch.Tensor, heads: int, width: int, pe: int) -> torch.Tensor:
    """Rows [heads, width] whose last `pe` of each head are [x_0..x_{pe/2-1}, y_0..] -> [x_0, y_0, x_1,
    y_1, ..]: rotate-half's channel order as the pairs megafab rotates (rope_interleave false)."""
    rows = w.reshape(heads, width, *w.shape[1:])
    nope, rot = rows[:, :width - pe], rows[:, width - pe:]
    first, second = rot.chunk(2, dim=1)
    paired = torch.stack([first, second], dim=2).reshape(heads, pe, *w.shape[1:])
    return torch.cat([nope, paired], dim=1).reshape(w.shape)


def check_exportable(m: ModelConfig, moe) -> None:
    if moe.num_experts is None:
        raise ConversionError(f"a dense multi-latent attention model: HF {NAME} has MoE layers after "
                              f"its first_k_dense_replace dense ones; this model cannot be exported to "
                              f"HuggingFace")
    problems = [p for p in hf_moe.export_problems(m, moe, NAME)
                if not p.startswith(("--moe-router-score-function", "--moe-router-enable-expert-bias",
                                     "--moe-router-topk-scaling-factor", "--moe-router-group-topk",
                                     "--moe-shared-expert-intermediate-size"))]
    problems += [p for p in hf_llama.hf_variant_problems(m, NAME) if not p.startswith("--qk-layernorm")]
    wants = (("--multi-latent-attention", m.multi_latent_attention, True),
             ("--qk-layernorm", m.qk_layernorm, True), ("--rotary-percent", m.rotary_percent, 1.0),
             ("--normalization", m.normalization, "RMSNorm"), ("--swiglu", m.swiglu, True),
             ("--norm-epsilon", m.norm_epsilon, LATENT_NORM_EPS),
             ("--moe-router-score-function", moe.moe_router_score_function, "sigmoid"),
             ("--moe-router-enable-expert-bias", moe.moe_router_enable_expert_bias, True),
             ("--moe-shared-expert-gate", moe.moe_shared_expert_gate, False))
    problems += [f"{flag} {have} (HF {NAME} has {want})" for flag, have, want in wants if have != want]
    shared, ffn = moe.moe_shared_expert_intermediate_size, moe.ffn_hidden_size(m.ffn_hidden_size)
    if not shared or shared % ffn:
        problems.append(f"--moe-shared-expert-intermediate-size {shared} (HF {NAME} has n_shared_experts "
                        f"shared experts of moe_intermediate_size {ffn} each)")
    pattern = [moe.is_moe_layer(i) for i in range(m.num_layers)]
    dense = pattern.index(True) if True in pattern else m.num_layers
    if pattern != [False] * dense + [True] * (m.num_layers - dense) or dense == m.num_layers:
        problems.append(f"--moe-layer-freq {moe.moe_layer_freq} (HF {NAME} has first_k_dense_replace "
                        f"dense layers, then MoE layers only)")
    if m.mtp_num_layers and not pattern[-1]:
        problems.append("--mtp-num-layers with a dense last layer (HF's MTP layers are MoE layers)")
    problems += hf_rope_yarn.export_problems(m)
    problems += _routing_problems(moe.num_experts, moe.moe_router_topk, moe.moe_router_num_groups,
                                  moe.moe_router_group_topk, moe.moe_router_topk > 1)
    if problems:
        raise ConversionError(f"HF {NAME} cannot express {'; '.join(problems)}; this model cannot be "
                              f"exported as {NAME}")


def _routing_problems(experts, topk, groups, group_topk, normalized) -> list[str]:
    out = []
    if normalized != (topk > 1):
        out.append(f"norm_topk_prob {normalized} with num_experts_per_tok {topk}: megatron-core "
                   f"normalizes the chosen sigmoid scores exactly when it picks more than one expert")
    if groups and groups > 1 and group_topk not in (None, groups) and topk != 2 * group_topk:
        out.append(f"n_group {groups}, topk_group {group_topk} with num_experts_per_tok {topk}: HF scores "
                   f"a group by its top 2 experts, megatron-core by its top topk/topk_group = "
                   f"{topk // group_topk} (equal only when num_experts_per_tok = 2 x topk_group)")
    return out


def to_hf_config(m: ModelConfig, moe, eod: int | None = None, bos: int | None = None):
    """The transformers DeepseekV3Config of megafab model config `m` and MoE settings `moe`."""
    from transformers import DeepseekV3Config

    check_exportable(m, moe)
    ffn = moe.ffn_hidden_size(m.ffn_hidden_size)
    groups = moe.moe_router_num_groups if moe.moe_router_group_topk else None
    return DeepseekV3Config(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        moe_intermediate_size=ffn, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_attention_heads,
        n_shared_experts=moe.moe_shared_expert_intermediate_size // ffn,
        n_routed_experts=moe.num_experts, routed_scaling_factor=moe.moe_router_topk_scaling_factor or 1.0,
        kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank, qk_rope_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim, qk_nope_head_dim=m.qk_head_dim, n_group=groups or 1,
        topk_group=moe.moe_router_group_topk or 1, num_experts_per_tok=moe.moe_router_topk,
        first_k_dense_replace=next(i for i in range(m.num_layers) if moe.is_moe_layer(i)),
        norm_topk_prob=moe.moe_router_topk > 1, hidden_act="silu",
        max_position_embeddings=m.max_position_embeddings, initializer_range=m.init_method_std,
        rms_norm_eps=m.norm_epsilon, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        rope_parameters=hf_rope_yarn.to_hf(m), rope_interleave=True, attention_bias=False,
        attention_dropout=m.attention_dropout, num_nextn_predict_layers=m.mtp_num_layers or 0,
        bos_token_id=bos, eos_token_id=eod, architectures=["DeepseekV3ForCausalLM"])


def from_hf_config(c: dict) -> dict:
    """Flat megafab fields (model and cfg.moe) from a DeepSeek-V3 config.json dict; one
    ConversionError for any value megafab does not reproduce exactly."""
    heads, experts, topk = c["num_attention_heads"], c["n_routed_experts"], c["num_experts_per_tok"]
    refusals = [(c.get("hidden_act", "silu") != "silu", "hidden_act", "megafab's SwiGLU uses SiLU"),
                (bool(c.get("attention_bias")), "attention_bias", "megafab's MLA projections have no biases"),
                (c.get("num_key_value_heads") not in (None, heads), "num_key_value_heads",
                 f"multi-latent attention gives every one of the {heads} heads its own keys and values"),
                (c.get("rms_norm_eps", 1e-6) != LATENT_NORM_EPS, "rms_norm_eps",
                 "transformers normalizes the q/kv latents with eps 1e-6 whatever rms_norm_eps says, "
                 "megafab's norms share one --norm-epsilon; only 1e-6 converts exactly"),
                (c.get("first_k_dense_replace", 0) >= c["num_hidden_layers"], "first_k_dense_replace",
                 "a model with no MoE layer is not a DeepSeek-V3 mixture of experts"),
                (not c.get("n_shared_experts"), "n_shared_experts",
                 "megafab's DeepSeek-V3 layers have shared experts (--moe-shared-expert-intermediate-size)"),
                (c.get("quantization_config") is not None, "quantization_config",
                 "megafab imports unquantized weights (DeepSeek's own release stores FP8 blocks with "
                 "weight_scale_inv); save_pretrained a dequantized (bf16) copy and import that")]
    for bad, field, rule in refusals:
        if bad:
            raise ConversionError(f"config.json {field} {c.get(field)!r}: {rule}; megafab cannot import this "
                                  f"model exactly")
    groups, group_topk = c.get("n_group") or 1, c.get("topk_group") or 1
    normalized = bool(c.get("norm_topk_prob", True))
    problems = _routing_problems(experts, topk, groups, group_topk, normalized)
    if problems:
        raise ConversionError(f"config.json {problems[0]}; megafab cannot import this routing exactly")
    grouped = groups > 1 and group_topk < groups
    dense = c.get("first_k_dense_replace", 0)
    flat = hf_llama.from_hf_config({**c, "head_dim": None, "rope_parameters": None, "rope_scaling": None})
    for key in ("kv_channels", "group_query_attention", "num_query_groups", "rotary_base"):
        flat.pop(key)
    flat.update(**hf_rope_yarn.from_hf(c), multi_latent_attention=True, qk_layernorm=True,
                q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=c["kv_lora_rank"],
                qk_head_dim=c["qk_nope_head_dim"], qk_pos_emb_head_dim=c["qk_rope_head_dim"],
                v_head_dim=c["v_head_dim"], num_experts=experts, moe_router_topk=topk,
                moe_ffn_hidden_size=c["moe_intermediate_size"],
                moe_layer_freq=tuple([0] * dense + [1] * (c["num_hidden_layers"] - dense)) if dense else 1,
                moe_shared_expert_intermediate_size=c["moe_intermediate_size"] * c["n_shared_experts"],
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_pre_softmax=False, moe_router_dtype="fp32",
                moe_router_topk_scaling_factor=c.get("routed_scaling_factor") or None,
                moe_router_num_groups=groups if grouped else None,
                moe_router_group_topk=group_topk if grouped else None,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="alltoall")
    return flat


def _layer_map(m: ModelConfig, moe, i: int) -> dict:
    """HF name -> megafab name of one layer's 1:1 tensors (layer-relative)."""
    out = {"self_attn." + k: "self_attention." + v for k, v in _attention_names(m).items()}
    out.update(_NORMS)
    if moe.is_moe_layer(i):
        out.update(_ROUTER)
    return out


def _layer_to_hf(sd: dict, src: str, dst: str, m: ModelConfig, moe, i: int) -> dict:
    out = {dst + hf: sd[src + mf] for hf, mf in _layer_map(m, moe, i).items()}
    if not moe.is_moe_layer(i):
        return {**out, **hf_llama.dense_mlp_to_hf(sd, src, dst)}
    fc1, fc2 = sd[src + EXPERTS + "linear_fc1.weight"], sd[src + EXPERTS + "linear_fc2.weight"]
    out.update(hf_moe.experts_to_hf(fc1, fc2, dst, _EXPERT_ROOT, _EXPERT_NAMES))
    gate, up = sd[src + "mlp.shared_experts.linear_fc1.weight"].chunk(2, dim=0)
    down = sd[src + "mlp.shared_experts.linear_fc2.weight"]
    out.update({dst + n: t.contiguous() for n, t in zip(_SHARED, (gate, up, down))})
    return out


def _layer_from_hf(hf: dict, src: str, dst: str, m: ModelConfig, moe, i: int, interleaved: bool) -> dict:
    out = {dst + mf: hf[src + name] for name, mf in _layer_map(m, moe, i).items()}
    if not interleaved:  # rotate-half order -> the pairs megafab rotates
        heads, pe = m.num_attention_heads, m.qk_pos_emb_head_dim
        q = dst + "self_attention." + _attention_names(m)["q_proj.weight" if m.q_lora_rank is None
                                                           else "q_b_proj.weight"]
        out[q] = interleave_halves(out[q], heads, m.qk_head_dim + pe, pe)
        kv = dst + "self_attention.linear_kv_down_proj.weight"
        out[kv] = interleave_halves(out[kv], 1, m.kv_lora_rank + pe, pe)
    if not moe.is_moe_layer(i):
        return {**out, **hf_llama.dense_mlp_from_hf(hf, src, dst)}
    fc1, fc2 = hf_moe.experts_from_hf(hf, src, _EXPERT_ROOT, moe.num_experts, _EXPERT_NAMES)
    gate, up, down = (hf[src + n] for n in _SHARED)
    out.update({dst + EXPERTS + "linear_fc1.weight": fc1, dst + EXPERTS + "linear_fc2.weight": fc2,
                dst + "mlp.shared_experts.linear_fc1.weight": torch.cat([gate, up]),
                dst + "mlp.shared_experts.linear_fc2.weight": down})
    return out


def _layer_hf_keys(m: ModelConfig, moe, i: int) -> list[str]:
    mlp = ([*hf_moe.hf_expert_keys(_EXPERT_ROOT, moe.num_experts, _EXPERT_NAMES), *_SHARED]
           if moe.is_moe_layer(i) else list(hf_llama.DENSE_MLP))
    return [*_layer_map(m, moe, i), *mlp]


def hf_expected_keys(m: ModelConfig, moe) -> set[str]:
    keys = hf_llama.hf_base_keys(m)
    for i in range(m.num_layers):
        keys.update(layer_prefix(i, HF_LAYERS) + n for n in _layer_hf_keys(m, moe, i))
    return keys


def _mtp_prefix(depth: int) -> str:
    return layer_prefix(depth, MTP_LAYERS)


def to_hf_state_dict(sd: dict[str, torch.Tensor], m: ModelConfig, moe) -> dict[str, torch.Tensor]:
    """Full megafab state dict -> DeepseekV3ForCausalLM's, MTP depths as layers num_layers + k."""
    check_exportable(m, moe)
    check_keys(sd, expected_keys(m, moe), "the megafab state dict")
    if m.apply_layernorm_1p:  # stored gamma - 1 (state_dict.plain_norm_weights), here MLA's and MTP's too
        sd = {k: (v + 1 if k.endswith(_NORM_SUFFIXES) else v) for k, v in sd.items()}
    out = hf_llama.base_to_hf(sd, m)
    last, layers = m.num_layers - 1, range(m.num_layers + (m.mtp_num_layers or 0))
    for i in progress(layers, desc=f"export to HF {NAME}", unit="layer"):
        dst = layer_prefix(i, HF_LAYERS)
        if i < m.num_layers:
            out.update(_layer_to_hf(sd, layer_prefix(i), dst, m, moe, i))
            continue
        src = _mtp_prefix(i - m.num_layers)
        out.update(_layer_to_hf(sd, src + MTP_TRANSFORMER_LAYER, dst, m, moe, last))
        out.update({dst + hf: sd[src + mf] for hf, mf in _MTP.items()})
        embedding = out["model.embed_tokens.weight"]  # DeepSeek's copies (safetensors stores no aliases)
        out.update({dst + "embed_tokens.weight": embedding.clone(),
                    dst + "shared_head.head.weight": out.get("lm_head.weight", embedding).clone()})
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], m: ModelConfig, moe,
                       hf_config: dict | None = None) -> dict[str, torch.Tensor]:
    """DeepseekV3ForCausalLM's state dict -> full megafab state dict (vocabulary padded); MTP layers
    (model.layers.<num_layers + k>) are left out, as transformers' DeepseekV3ForCausalLM leaves them."""
    interleaved = (hf_config or {}).get("rope_interleave", True)
    hf = {k: v for k, v in hf_llama.hf_weights(hf, m).items() if not _is_mtp_key(k, m.num_layers)}
    check_keys(hf, hf_expected_keys(m, moe), f"the HF {NAME} weights")
    sd = hf_llama.base_from_hf(hf, m)
    for i in progress(range(m.num_layers), desc=f"import from HF {NAME}", unit="layer"):
        sd.update(_layer_from_hf(hf, layer_prefix(i, HF_LAYERS), layer_prefix(i), m, moe, i, interleaved))
    return sd


def _is_mtp_key(key: str, num_layers: int) -> bool:
    """A HF layer past the decoder's: DeepSeek's MTP layers (num_hidden_layers + k)."""
    parsed = parse_index(key, HF_LAYERS)
    return parsed is not None and parsed[0] >= num_layers
