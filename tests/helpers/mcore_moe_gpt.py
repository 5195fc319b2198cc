"""megatron-core 0.16.1's MoE GPTModel (local spec, SequentialMLP experts, a gated shared expert,
QK-norm, alltoall) on CPU as the oracle for MoE checkpoints, and the same model as megafab's Config.
The CPU workarounds are tests/helpers/mcore_moe.py's and tests/helpers/mcore.py's."""

from __future__ import annotations

import contextlib
import dataclasses
import zlib

import torch
import torch.nn.functional as F

from megafab.config import Config
from megafab.convert.state_dict import finalize_model_config
from tests.helpers.flags import TINY_GPT

EXPERTS, TOPK, LAYERS = 4, 2, 2
MODEL = dict(TINY_GPT, num_layers=LAYERS, ffn_hidden_size=48, kv_channels=8,
             group_query_attention=False, num_query_groups=4, max_position_embeddings=64,
             position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, normalization="RMSNorm",
             norm_epsilon=1e-5, swiglu=True, add_bias_linear=False, qk_layernorm=True,
             untie_embeddings_and_output_weights=True, vocab_size=128, make_vocab_size_divisible_by=128,
             hidden_dropout=0.0, attention_dropout=0.0)
MOE = dict(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=40,
           moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True,
           moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
           moe_aux_loss_coeff=0.0)
# gpt-oss's MLP instead (megafab_config / megatron_args overrides): clamped quick-GEGLU with the +1
# offset (the clamp bites at these weights), biases on every linear and the router, no shared expert
# (megatron-core's shared experts take no bias)
GPT_OSS = dict(swiglu=False, quick_geglu=True, activation_func_clamp_value=0.3, glu_linear_offset=1.0,
               add_bias_linear=True, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)


def megafab_config(**moe) -> Config:
    flat = {**MODEL, **MOE, **moe}
    return dataclasses.replace(Config.from_flat(flat), model=finalize_model_config(flat))


@contextlib.contextmanager
def megatron_moe_ranks(ep: int):
    """megatron-core's parallel state at EP `ep` over the harness's ranks, with the MoE CPU patches
    (tests/helpers/mcore_moe.py) and the checkpoint ones (tests/helpers/mcore.py)."""
    from tests.helpers import mcore
    from tests.helpers.mcore_moe import megatron_moe_on_cpu

    with megatron_moe_on_cpu(expert_model_parallel_size=ep):
        mcore.cpu_workarounds()
        yield


def gpt_model(seed: int = 7, gpt_oss: bool = False):
    """This rank's megatron-core MoE GPTModel (gpt_oss: GPT_OSS's MLP); every rank draws the same
    full weights (CPU init from one seed) and keeps its experts."""
    from megatron.core import parallel_state as ps
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = {**MODEL, **MOE, **(GPT_OSS if gpt_oss else {})}
    mlp = dict(activation_func=quick_gelu, activation_func_clamp_value=m["activation_func_clamp_value"],
               glu_linear_offset=m["glu_linear_offset"]) if gpt_oss else dict(activation_func=F.silu)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"], kv_channels=m["kv_channels"], normalization="RMSNorm",
        layernorm_epsilon=m["norm_epsilon"], gated_linear_unit=True, **mlp,
        add_bias_linear=m["add_bias_linear"], hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, qk_layernorm=True, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=40, moe_shared_expert_intermediate_size=m["moe_shared_expert_intermediate_size"],
        moe_shared_expert_gate=m["moe_shared_expert_gate"],
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size())
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, normalization="RMSNorm", qk_layernorm=True)
    model = GPTModel(config, spec, vocab_size=m["vocab_size"],
                     max_sequence_length=m["max_position_embeddings"], position_embedding_type="rope",
                     share_embeddings_and_output_weights=False, parallel_output=False)
    ep_rank, local = ps.get_expert_model_parallel_rank(), EXPERTS // ps.get_expert_model_parallel_world_size()
    with torch.no_grad():  # values keyed by the global name: the same model at any EP
        for name, p in model.named_parameters():
            key = zlib.crc32(global_name(name, ep_rank, local).encode())
            gen = torch.Generator().manual_seed(seed + key)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def global_name(name: str, ep_rank: int, local: int) -> str:
    """megatron-core's local expert name with the global expert index."""
    if ".local_experts." not in name:
        return name
    head, tail = name.split(".local_experts.")
    i, rest = tail.split(".", 1)
    return f"{head}.local_experts.{ep_rank * local + int(i)}.{rest}"


def megatron_args(**extra):
    import argparse

    values = {**MODEL, **MOE, "padded_vocab_size": MODEL["vocab_size"], "tensor_model_parallel_size": 1,
              "pipeline_model_parallel_size": 1, "iteration": 10, "consumed_train_samples": 40,
              "add_position_embedding": False, "apply_layernorm_1p": False,
              "tokenizer_type": "NullTokenizer", "moe_layer_freq": 1, **extra}
    return argparse.Namespace(**values)
