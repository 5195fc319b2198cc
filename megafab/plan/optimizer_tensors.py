"""How many parameter tensors each rank's optimizer steps, as megafab builds the model and its
DDP buckets: the count the step-time model's per-tensor host overhead multiplies
(step_time.host_seconds). The tensors are the parts the engine builds on the meta device
(megafab.plan.inventory); the buckets megafab.distributed.data_parallel's own layout over them."""

from __future__ import annotations

import torch

from megafab.config.derive import default_bucket_size
from megafab.distributed.data_parallel import owned_ranges, plan_buckets
from megafab.plan.inventory import Tensor
from megafab.plan.params import LayerParams


def chunk_tensors(cfg, pp_rank: int, chunk: int, layers: LayerParams | None = None) -> list[Tensor]:
    """Each parameter tensor of one model chunk on one rank, in the chunk's order: the embedding
    (first chunk), its layers, the final norm and an untied (or last-stage tied) output layer."""
    layers = layers or LayerParams(cfg)
    ends = layers.ends(pp_rank, chunk)
    tensors = list(ends.head.tensors)
    for index in range(*layers.split.layer_range(pp_rank, chunk)):
        tensors += layers.inventory.layer(index).tensors
    return tensors + list(ends.tail.tensors)


def chunk_tensor_sizes(cfg, pp_rank: int, chunk: int) -> list[int]:
    """Elements of each parameter tensor of one model chunk on one rank, in the chunk's order."""
    return [t.numel for t in chunk_tensors(cfg, pp_rank, chunk)]


def _owned_tensors(cfg, sizes: list[int], tied: list[int], shards: int) -> int:
    """Most tensors a distributed-optimizer rank owns a piece of: megafab's own DDP bucket layout
    (megafab.distributed.data_parallel.plan_buckets: reverse order, buckets padded to `shards`,
    a tied embedding weight (indices `tied`) alone) over meta tensors of the sizes."""
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
    layers = LayerParams(cfg)
    chunks = [chunk_tensors(cfg, pp_rank, c, layers) for c in range(layers.chunk_count(pp_rank))]
    shards = (p.data_parallel_size or 1) * p.context_parallel_size
    if not p.use_distributed_optimizer or p.fully_sharded or shards == 1:
        return sum(len(c) for c in chunks)
    total = 0
    for chunk in chunks:
        tied = [i for i, t in enumerate(chunk) if t.shared_embedding]
        total += _owned_tensors(cfg, [t.numel for t in chunk], tied, shards)
    return total


def sharding_name(cfg) -> str:
    """"fsdp2", "distributed_optimizer" or "none" (DDP)."""
    p = cfg.parallel
    return "fsdp2" if p.fully_sharded else "distributed_optimizer" if p.use_distributed_optimizer else "none"
