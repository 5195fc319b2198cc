"""A tiny random transformers DeepSeek-V3 built locally (nothing downloaded) with its features on:
a query LoRA (or a direct query projection), YaRN with a short original context (16 of 64 positions)
and mscale_all_dim, a dense first layer, then MoE layers of 8 experts in 4 groups (2 kept, top-4)
with sigmoid scores, a nonzero expert correction bias, routed scaling and a shared expert."""

import torch

from tests.helpers.hf_tiny import VOCAB, _randomize

YARN = dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, mscale=0.9, mscale_all_dim=0.7)


def deepseek_config(q_lora_rank=24, rope=None, tied=False, rope_interleave=True, **overrides):
    """The transformers DeepseekV3Config of the tiny model (rope: its rope_parameters, default YARN)."""
    from transformers import DeepseekV3Config

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=q_lora_rank,
                  qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
                  num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=64,
                  rope_parameters=dict(rope or YARN), rope_interleave=rope_interleave, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    return DeepseekV3Config(**{**fields, **overrides})


def hf_deepseek_v3(seed=0, **config):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_config(**config)).eval()
    _randomize(model)
    with torch.no_grad():  # a correction bias large enough to change which experts are chosen
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    return model


def with_mtp(sd: dict, cfg, seed=1):
    """(sd, cfg) of the same model with one MTP layer (--mtp-num-layers 1): its transformer layer a
    perturbed copy of the last decoder layer, random norms and eh_proj."""
    g = torch.Generator().manual_seed(seed)
    cfg.model.mtp_num_layers = 1
    last, h = f"decoder.layers.{cfg.model.num_layers - 1}.", cfg.model.hidden_size
    out = dict(sd)
    for key, value in sd.items():
        if key.startswith(last):
            noise = torch.randn(value.shape, generator=g) * 0.05
            out["mtp.layers.0.transformer_layer." + key[len(last):]] = value + noise
    for norm in ("enorm", "hnorm", "final_layernorm"):
        out[f"mtp.layers.0.{norm}.weight"] = 1 + torch.randn(h, generator=g) * 0.1
    out["mtp.layers.0.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
    return out, cfg
