"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM) <-> megafab: Llama's attention with QK-norm
(self_attn.q_norm / k_norm: RMSNorm over each head's channels before RoPE = --qk-layernorm), MoE
layers (mlp.gate [E, h]; mlp.experts.N.gate_proj / up_proj / down_proj) where decoder_sparse_step
and mlp_only_layers put them, dense Llama MLPs elsewhere; routing by norm_topk_prob (hf_moe.py).
"""

from __future__ import annotations

from megafab.config import ModelConfig
from megafab.convert import hf_llama, hf_moe
from megafab.convert.state_dict import ConversionError

ROUTER = "mlp.gate.weight"
EXPERTS = "mlp.experts."
NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def moe_layer_pattern(c: dict) -> int | tuple[int, ...]:
    """--moe-layer-freq of a Qwen3-MoE config: 1 (every layer MoE) or a 0/1 pattern."""
    step, dense = c.get("decoder_sparse_step", 1) or 1, set(c.get("mlp_only_layers") or [])
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(c["num_hidden_layers"]))
    return 1 if all(pattern) else pattern


def check_exportable(m: ModelConfig, moe) -> None:
    problems = hf_moe.export_problems(m, moe, "Qwen3-MoE")
    if not m.qk_layernorm:
        problems.append("no --qk-layernorm (HF Qwen3-MoE always normalizes q and k; export as Mixtral)")
    if problems:
        raise ConversionError(f"HF Qwen3-MoE cannot express {', '.join(problems)}; this model cannot be "
                              f"exported as Qwen3-MoE")
    hf_llama.check_exportable(m, allow_qk_layernorm=True)


def to_hf_config(m: ModelConfig, moe, eod: int | None = None, bos: int | None = None):
    from transformers import Qwen3MoeConfig

    check_exportable(m, moe)
    dense = [i for i in range(m.num_layers) if not moe.is_moe_layer(i)]
    return Qwen3MoeConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        moe_intermediate_size=moe.ffn_hidden_size(m.ffn_hidden_size), num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups,
        head_dim=m.kv_channels, hidden_act="silu", max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.norm_epsilon, rope_parameters=hf_llama.rope_to_hf(m), attention_bias=False,
        attention_dropout=m.attention_dropout, initializer_range=m.init_method_std,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights, num_experts=moe.num_experts,
        num_experts_per_tok=moe.moe_router_topk, norm_topk_prob=hf_moe.norm_topk_prob(moe),
        decoder_sparse_step=1, mlp_only_layers=dense,
        router_aux_loss_coef=moe.aux_loss_coeff("aux_loss"), use_sliding_window=False,
        bos_token_id=bos, eos_token_id=eod, architectures=["Qwen3MoeForCausalLM"])


def from_hf_config(c: dict) -> dict:
    """Flat megafab fields (model and cfg.moe) from a Qwen3-MoE config.json dict."""
    hf_moe.refuse_sliding_window(c, "Qwen3-MoE")
    flat = hf_llama.from_hf_config(c)
    experts = c.get("num_experts") or c.get("num_local_experts")  # transformers 5 saves the latter
    flat.update(qk_layernorm=True, num_experts=experts,
                moe_router_topk=c["num_experts_per_tok"],
                moe_ffn_hidden_size=c["moe_intermediate_size"], moe_layer_freq=moe_layer_pattern(c),
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=c.get("router_aux_loss_coef", 0.0),
                moe_token_dispatcher_type="alltoall",
                **hf_moe.router_settings(norm_topk_prob=bool(c.get("norm_topk_prob", False))))
    return flat


FAMILY = hf_moe.Family("Qwen3-MoE", ROUTER, EXPERTS, NAMES, check_exportable)
to_hf_state_dict = FAMILY.to_hf_state_dict  # full megafab state dict -> the HF model's
from_hf_state_dict = FAMILY.from_hf_state_dict
