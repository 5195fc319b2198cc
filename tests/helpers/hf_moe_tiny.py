"""Tiny random HF Mixtral / Qwen3-MoE models built locally from their configs (nothing downloaded)."""

import torch

from tests.helpers.hf_tiny import VOCAB, _randomize

EXPERTS, TOPK = 4, 2


def hf_mixtral(seed=0, tied=False):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                        rms_norm_eps=1e-5, rope_theta=5000.0, num_local_experts=EXPERTS,
                        num_experts_per_tok=TOPK, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                        router_aux_loss_coef=0.01)
    model = MixtralForCausalLM(cfg).eval()
    _randomize(model)
    return model


def hf_qwen3_moe(seed=0, norm_topk_prob=False, mlp_only_layers=(1,)):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
                         num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=norm_topk_prob,
                         mlp_only_layers=list(mlp_only_layers), tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    model = Qwen3MoeForCausalLM(cfg).eval()
    _randomize(model)
    return model
