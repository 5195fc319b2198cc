"""Mixtral (transformers' MixtralForCausalLM) <-> megafab: Llama's attention and norms (hf_llama),
every layer's MLP a mixture of experts (block_sparse_moe.gate [E, h]; experts.N.w1 gate, w3 up,
w2 down), routed as hf_moe.py says (top-k of the logits, softmax over the k).
"""

from __future__ import annotations

from megafab.config import ModelConfig
from megafab.convert import hf_llama, hf_moe
from megafab.convert.state_dict import ConversionError

ROUTER = "block_sparse_moe.gate.weight"
EXPERTS = "block_sparse_moe.experts."
NAMES = ("w1.weight", "w3.weight", "w2.weight")  # gate, up, down


def check_exportable(m: ModelConfig, moe) -> None:
    problems = hf_moe.export_problems(m, moe, "Mixtral")
    if moe.moe_router_pre_softmax:
        problems.append("--moe-router-pre-softmax (HF Mixtral renormalizes the chosen probabilities; "
                        "export as Qwen3-MoE with norm_topk_prob false instead)")
    if moe.moe_layer_freq != 1:
        problems.append(f"--moe-layer-freq {moe.moe_layer_freq} (every HF Mixtral layer is MoE)")
    if problems:
        raise ConversionError(f"HF Mixtral cannot express {', '.join(problems)}; this model cannot be "
                              f"exported as Mixtral")
    hf_llama.check_exportable(m)


def to_hf_config(m: ModelConfig, moe, eod: int | None = None, bos: int | None = None):
    from transformers import MixtralConfig

    check_exportable(m, moe)
    return MixtralConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=moe.ffn_hidden_size(m.ffn_hidden_size),
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, head_dim=m.kv_channels, hidden_act="silu",
        max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.norm_epsilon,
        rope_parameters=hf_llama.rope_to_hf(m), attention_dropout=m.attention_dropout,
        initializer_range=m.init_method_std,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        num_local_experts=moe.num_experts, num_experts_per_tok=moe.moe_router_topk,
        router_aux_loss_coef=moe.aux_loss_coeff("aux_loss"),
        router_jitter_noise=moe.moe_input_jitter_eps or 0.0,
        sliding_window=None, bos_token_id=bos, eos_token_id=eod, architectures=["MixtralForCausalLM"])


def from_hf_config(c: dict) -> dict:
    """Flat megafab fields (model and cfg.moe) from a Mixtral config.json dict."""
    hf_moe.refuse_sliding_window(c, "Mixtral")
    flat = hf_llama.from_hf_config(c)
    jitter = c.get("router_jitter_noise") or None
    flat.update(num_experts=c["num_local_experts"], moe_router_topk=c["num_experts_per_tok"],
                moe_ffn_hidden_size=c["intermediate_size"], moe_layer_freq=1,
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=c.get("router_aux_loss_coef", 0.0),
                moe_input_jitter_eps=jitter, moe_token_dispatcher_type="alltoall",
                **hf_moe.router_settings(norm_topk_prob=True))
    return flat


FAMILY = hf_moe.Family("Mixtral", ROUTER, EXPERTS, NAMES, check_exportable)
to_hf_state_dict = FAMILY.to_hf_state_dict  # full megafab state dict -> the HF model's
from_hf_state_dict = FAMILY.from_hf_state_dict
