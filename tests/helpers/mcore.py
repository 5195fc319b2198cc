"""megatron-core 0.16.1 as the oracle for Megatron checkpoints, on CPU.

Its CPU path still touches CUDA in a few places; the workarounds live here, never in megafab:
torch.cuda.current_device() / synchronize() (RoPE, save's preload and failure broadcast), the
async writer's spawn-context result queue and psutil memory probe, the CUDA RNG tracker's fork
(dropout is off), and the default causal mask built on "cuda" (an explicit mask is passed), the
sliding-window mask too (window_mask_on_cpu).
Imported by the test modules before the harness forks, so ranks share the (slow) import.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.fusions import fused_softmax
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.transformer_config import TransformerConfig

from megafab.model.gpt import masked_mean_loss


def cpu_workarounds() -> None:
    """Call once per rank process (the harness forks each)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    filesystem_async._get_write_results_queue = queue.Queue
    filesystem_async._process_memory = lambda: 0
    mcore_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    fused_softmax.get_sliding_window_causal_mask = window_mask_on_cpu


def window_mask_on_cpu(sq, skv, window_size):
    """megatron-core's get_sliding_window_causal_mask (True: masked), built on the CPU."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


def init_parallel(tp: int, pp: int = 1) -> None:
    cpu_workarounds()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp)


def _as_list(freq):
    """megatron-core takes a --window-attn-skip-freq pattern as a list (megafab keeps a tuple)."""
    return list(freq) if isinstance(freq, tuple) else freq


def transformer_config(m, dtype=torch.float32) -> TransformerConfig:
    """megatron-core's config of megafab ModelConfig `m` (GPT-2 or Llama style)."""
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels, normalization=m.normalization, layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu or m.quick_geglu,
        activation_func=quick_gelu if m.quick_geglu else F.silu if m.swiglu else F.gelu,
        activation_func_clamp_value=m.activation_func_clamp_value, glu_linear_offset=m.glu_linear_offset,
        add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_qkv_bias, qk_layernorm=m.qk_layernorm,
        hidden_dropout=0.0, window_size=getattr(m, "window_size", None),
        window_attn_skip_freq=_as_list(getattr(m, "window_attn_skip_freq", None)),
        softmax_type=getattr(m, "softmax_type", "vanilla"),
        apply_query_key_layer_scaling=getattr(m, "apply_query_key_layer_scaling", False),
        rotary_interleaved=getattr(m, "rotary_interleaved", False),
        attention_dropout=0.0, use_cpu_initialization=True, params_dtype=dtype,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=dtype)


def gpt_model(m, seed: int = 7, dtype=torch.float32) -> GPTModel:
    """megatron-core's GPTModel (local spec) of this rank's pipeline stage, random weights
    (the same full weights on every TP rank: CPU init from one seed)."""
    torch.manual_seed(seed)
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    model = GPTModel(
        transformer_config(m, dtype),
        get_gpt_layer_local_spec(normalization=m.normalization, qk_layernorm=m.qk_layernorm),
        vocab_size=m.padded_vocab_size, max_sequence_length=m.max_position_embeddings,
        pre_process=pp_rank == 0, post_process=pp_rank == pp - 1, parallel_output=False,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type, rotary_percent=m.rotary_percent,
        rotary_base=m.rotary_base, rope_scaling=m.use_rope_scaling, rope_scaling_factor=m.rope_scaling_factor,
        seq_len_interpolation_factor=m.rotary_seq_len_interpolation_factor)
    for p in model.parameters():  # biases and norms start at 0 / 1: give every tensor values
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def causal_mask(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]


@torch.no_grad()
def logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """Full logits [b, s, V_padded] of a one-stage (PP 1) model, on every TP rank."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, attention_mask=causal_mask(tokens.shape[1]))


def megatron_args(m, tp: int, pp: int, iteration: int = 10, **extra) -> argparse.Namespace:
    """The args Megatron-LM's training loop records (the ones its loader and megafab read)."""
    values = dict(num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
                  num_attention_heads=m.num_attention_heads, kv_channels=m.kv_channels,
                  group_query_attention=m.group_query_attention, num_query_groups=m.num_query_groups,
                  max_position_embeddings=m.max_position_embeddings, seq_length=m.seq_length,
                  position_embedding_type=m.position_embedding_type, rotary_percent=m.rotary_percent,
                  rotary_base=m.rotary_base, normalization=m.normalization, norm_epsilon=m.norm_epsilon,
                  swiglu=m.swiglu, add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_qkv_bias,
                  untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
                  make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
                  padded_vocab_size=m.padded_vocab_size, tensor_model_parallel_size=tp,
                  pipeline_model_parallel_size=pp, consumed_train_samples=iteration * 4,
                  add_position_embedding=m.position_embedding_type == "learned_absolute",
                  apply_layernorm_1p=False, qk_layernorm=False, num_experts=None, iteration=iteration,
                  tokenizer_type="NullTokenizer", vocab_size=m.vocab_size)
    values.update(extra)
    return argparse.Namespace(**values)


def save(model: GPTModel, root: str, iteration: int = 10, common: dict | None = None) -> str:
    """megatron-core's dist_checkpointing.save of `model` into ROOT/iter_NNNNNNN, the tracker as
    Megatron's training loop writes it; `common`: non-sharded entries (args, iteration, ...)."""
    path = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), **(common or {})}
    dist_checkpointing.save(state, path, sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1,
                                                                                          thread_count=1))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return path


def load(model: GPTModel, path: str) -> None:
    """megatron-core's dist_checkpointing.load into `model` (strict: every key it asks for)."""
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(state["model"])


def train_step_equals(theirs, ours, m, tokens, labels, mask, tol: float = 1e-12) -> torch.Tensor:
    """Copy megatron-core GPTModel `theirs`' weights into megafab's `ours` (same names), run both on one
    batch with the masked mean loss and backward, and assert the per-token losses and every gradient
    agree within `tol`; returns megafab's per-token loss."""
    params = dict(ours.named_parameters())
    assert params.keys() == dict(theirs.named_parameters()).keys()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            params[name].copy_(p)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    ref_loss = theirs(tokens, positions, causal_mask(tokens.shape[1]), labels=labels)
    masked_mean_loss(ref_loss, mask).backward()
    loss = ours(tokens, labels=labels)
    masked_mean_loss(loss, mask).backward()
    assert (ref_loss - loss).abs().max().item() < tol
    for name, p in theirs.named_parameters():
        assert (p.grad - params[name].grad).abs().max().item() < tol, name
    return loss
