"""Tiny GPT configurations (the sizes of tests/helpers/flags.py's TINY_GPT) and gradient gathering
shared by the model and pipeline parity tests."""

import functools

import torch
import torch.distributed as dist

from megafab import checks
from megafab.config import Config
from megafab.distributed.layers import join_partitions
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.transformer import LayerContext
from tests.helpers.flags import TINY_GPT

GPT2_STYLE = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                  untie_embeddings_and_output_weights=False, add_bias_linear=True)
LLAMA_STYLE = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                   untie_embeddings_and_output_weights=True, add_bias_linear=False,
                   group_query_attention=True, num_query_groups=2, rotary_percent=0.5)


def tiny_config(tp=1, pp=1, style=GPT2_STYLE, **overrides):
    flat = dict(TINY_GPT, vocab_size=101, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                attention_dropout=0.0, micro_batch_size=2, train_iters=1, lr=1e-3, mock_data=True,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    flat.update(style)
    flat.update(overrides)
    cfg = Config.from_flat(flat)
    checks.finalize(cfg, world_size=tp * pp * flat.get("dp", 1))
    return cfg


def context(tp_group=None, sequence_parallel=False, seed=1234, tracker=None, dtype=torch.float64):
    return LayerContext(tp_group, sequence_parallel, dtype, torch.device("cpu"), seed, tracker)


def reference_model(model_cfg, seed=1234, tracker=None):
    """The single-process model: same config (same padded vocab), no groups."""
    return GPTModel(model_cfg, context(seed=seed, tracker=tracker))


def batch(model_cfg, micro_batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model_cfg.vocab_size, (micro_batch, model_cfg.seq_length + 1), generator=g)
    mask = (torch.rand(micro_batch, model_cfg.seq_length, generator=g) > 0.2).double()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def full_grad(param, tp_group):
    """The gradient of the unsharded parameter: TP shards joined, replicated grads as they are."""
    grad = param.grad
    if not getattr(param, "tensor_model_parallel", False) or tp_group is None:
        return grad
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, grad.contiguous(), group=tp_group)
    return join_partitions(parts, param.partition_dim, param.partition_stride)


def reduce_sequence_parallel_grads(model, tp_group):
    """What finalize_model_grads does under SP: sum replicated params' partial grads over TP."""
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=tp_group)


def loss_func(mask, per_token_loss):
    """Megatron's loss_func for test schedules: masked mean and its log."""
    loss = masked_mean_loss(per_token_loss, mask)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    """forward_step_func over an iterator of (tokens, labels, mask) micro-batches."""
    tokens, labels, mask = next(data_iterator)
    return model(tokens, labels=labels), functools.partial(loss_func, mask)
