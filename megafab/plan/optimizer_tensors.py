"""How many parameter tensors each rank's optimizer steps, as megafab builds the model and its
DDP buckets: the count the step-time model's per-tensor host overhead multiplies
(step_time.host_seconds). Meta tensors only; nothing is built."""

from __future__ import annotations

from megafab.config.moe import moe_settings
from megafab.pipeline_split import PipelineSplit
from megafab.plan.moe import expert_sizes, is_moe_layer


def _layer_tensor_sizes(cfg, index: int, tp: int) -> list[int]:
    """Elements of each parameter tensor of global layer `index` on one TP rank, as megafab builds
    it: the two norms (weight, LayerNorm's bias), q/k layernorms, QKV and projection (weights,
    biases), then the dense MLP's fc1 and fc2, or an MoE MLP's router, each local expert's fc1 and
    fc2 (grouped GEMM: one fc1 and one fc2 for them all) and the shared experts."""
    m, moe = cfg.model, moe_settings(cfg)
    h, d, a, g = m.hidden_size, m.kv_channels, m.num_attention_heads, m.num_query_groups
    norm = [h, h] if m.normalization == "LayerNorm" else [h]
    bias = m.add_bias_linear
    qkv = (a + 2 * g) * d // tp
    sizes = norm + ([n * d // h for n in norm] * 2 if m.qk_layernorm else [])
    sizes += [h * qkv] + ([qkv] if bias or m.add_qkv_bias else []) + [a * d * h // tp] + ([h] if bias else [])
    sizes += norm

    def mlp(f: int, parts: int) -> list[int]:
        fc1 = f * (2 if m.swiglu else 1) // parts
        return [h * fc1] + ([fc1] if bias else []) + [f // parts * h] + ([h] if bias else [])

    if not is_moe_layer(moe, index):
        return sizes + mlp(m.ffn_hidden_size, tp)
    ep, etp = expert_sizes(cfg)
    sizes += [moe.num_experts * h] + ([moe.num_experts] if bias else [])
    local, expert = moe.num_experts // ep, mlp(moe.ffn_hidden_size(m.ffn_hidden_size), etp)
    sizes += [local * n for n in expert] if moe.moe_grouped_gemm else expert * local
    if moe.moe_shared_expert_intermediate_size:
        f_s = moe.moe_shared_expert_intermediate_size  # no biases (moe_mlp_params)
        sizes += [h * f_s * (2 if m.swiglu else 1) // tp, f_s // tp * h]
        sizes += [h] if moe.moe_shared_expert_gate else []
    return sizes


def chunk_tensor_sizes(cfg, pp_rank: int, chunk: int) -> list[int]:
    """Elements of each parameter tensor of one model chunk on one TP rank, in the chunk's order:
    the embedding (first chunk), its layers, the final norm and an untied output layer (last)."""
    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    split = PipelineSplit.from_config(cfg)
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == p.pipeline_model_parallel_size - 1 and chunk == len(split.counts()[pp_rank]) - 1
    word = m.padded_vocab_size * m.hidden_size // tp
    sizes = []
    if first:
        sizes += [word] + ([m.max_position_embeddings * m.hidden_size]
                           if m.position_embedding_type == "learned_absolute" else [])
    for index in range(*split.layer_range(pp_rank, chunk)):
        sizes += _layer_tensor_sizes(cfg, index, tp)
    if last:
        sizes += [m.hidden_size] * (2 if m.normalization == "LayerNorm" else 1)
        if m.untie_embeddings_and_output_weights or not first:
            sizes.append(word)
    return sizes


def _owned_tensors(cfg, sizes: list[int], tied: list[int], shards: int) -> int:
    """Most tensors a distributed-optimizer rank owns a piece of: megafab's own DDP bucket layout
    (megafab.distributed.data_parallel.plan_buckets: reverse order, buckets padded to `shards`,
    a tied embedding weight (indices `tied`) alone) over meta tensors of the sizes."""
    import torch

    from megafab.config.derive import default_bucket_size
    from megafab.distributed.data_parallel import owned_ranges, plan_buckets

    params = [torch.empty(n, device="meta") for n in sizes]
    for i in tied:
        params[i].shared_embedding = True
    p = cfg.parallel
    size = p.ddp_bucket_size or (default_bucket_size(shards) if p.overlap_grad_reduce else None)
    buckets, offsets = plan_buckets(params[::-1], shards, size, True)
    return max(len(owned_ranges(buckets, offsets, r)) for r in range(shards))


def param_tensors(cfg, pp_rank: int) -> int:
    """Parameter tensors the optimizer of a rank of pipeline stage `pp_rank` steps (every chunk):
    DDP all of them; the distributed optimizer those its 1/DP shard of each chunk's gradient
    buckets touches (the dense ones; an MoE model's expert buckets are not split apart here);
    FSDP2 each tensor's shard."""
    p = cfg.parallel
    chunks = len(PipelineSplit.from_config(cfg).counts()[pp_rank])
    sizes = [chunk_tensor_sizes(cfg, pp_rank, c) for c in range(chunks)]
    shards = (p.data_parallel_size or 1) * p.context_parallel_size
    if not p.use_distributed_optimizer or p.fully_sharded or shards == 1:
        return sum(len(s) for s in sizes)
    tied = not cfg.model.untie_embeddings_and_output_weights
    last = (p.pipeline_model_parallel_size - 1, chunks - 1)
    total = 0
    for c, chunk in enumerate(sizes):
        ends = ([0] if (pp_rank, c) == (0, 0) else []) + ([len(chunk) - 1] if (pp_rank, c) == last
                                                           and (pp_rank, c) != (0, 0) else [])
        total += _owned_tensors(cfg, chunk, ends if tied else [], shards)
    return total


def sharding_name(cfg) -> str:
    """"fsdp2", "distributed_optimizer" or "none" (DDP)."""
    p = cfg.parallel
    return "fsdp2" if p.fully_sharded else "distributed_optimizer" if p.use_distributed_optimizer else "none"
