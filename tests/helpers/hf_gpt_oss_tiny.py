"""A tiny random transformers gpt-oss built locally (nothing downloaded) with its features on: 4
layers alternating sliding (window 5) and full attention, randomized (nonzero) sinks, YaRN with a
short original context (16 of 64 positions), GQA with q/k/v/o biases, 4 experts top-2 with nonzero
router and expert biases and a small swiglu_limit that clamps, untied embeddings."""

import torch

from tests.helpers.hf_tiny import VOCAB, _randomize

WINDOW = 5  # HF's sliding_window: a query sees itself and the 4 positions before it
LIMIT = 0.3  # swiglu_limit: small enough that the clamp bites on these weights
YARN = dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, truncate=False)


def gpt_oss_config(tied=False, rope=None, **overrides):
    """The transformers GptOssConfig of the tiny model (rope: its rope_parameters, default YARN)."""
    from transformers import GptOssConfig

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=12, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                  num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=64,
                  rope_parameters=dict(rope or YARN), rms_norm_eps=1e-5, swiglu_limit=LIMIT,
                  router_aux_loss_coef=0.02, tie_word_embeddings=tied, attention_bias=True,
                  bos_token_id=1, eos_token_id=2)
    return GptOssConfig(**{**fields, **overrides})


def hf_gpt_oss(seed=0, **config):
    """GptOssForCausalLM (eager attention) with every tensor perturbed; sinks, router and expert
    biases large enough to change the attention and the experts chosen."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(gpt_oss_config(**config)).eval()
    _randomize(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape))
            experts = layer.mlp.experts
            layer.mlp.router.bias.copy_(torch.randn(layer.mlp.router.bias.shape) * 0.5)
            experts.gate_up_proj.mul_(10.0)  # pre-activations past the limit
            experts.gate_up_proj_bias.copy_(torch.randn(experts.gate_up_proj_bias.shape) * 0.3)
            experts.down_proj_bias.copy_(torch.randn(experts.down_proj_bias.shape) * 0.3)
    return model
