"""Every cross-group gradient reduction after the last backward of a step, in one place.

The schedule calls `finalize_model_grads(model_chunks, topology=..., sequence_parallel=...)` once,
after the last micro-batch's backward and before the optimizer step. In Megatron's order:

  1. data parallel, over DP x CP (expert params over expert-DP): the DDP buckets' all-reduce or
     reduce-scatter (data_parallel.py); FSDP2 chunks reduce-scattered during backward already;
  2. TP-replicated params whose gradients are partial on each TP rank, summed over TP
     (allreduce_tp_partial_grads);
  3. the two copies of the tied word embedding (PP > 1), summed over the embedding group
     (allreduce_embedding_grads).

All three are sums (DP also scales by 1/DP), so their order does not change the result; under the
distributed optimizer and FSDP2, 2 and 3 stay right on the shard this rank owns (finalize_model_grads).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megafab.distributed.data_parallel import is_expert_param
from megafab.distributed.fsdp import local_tensor


def grad_of(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient the optimizer reads: `main_grad` under DDP, this rank's shard of `.grad` under
    FSDP2, else `.grad`."""
    if hasattr(param, "main_grad"):
        return param.main_grad
    return None if param.grad is None else local_tensor(param.grad)


def _all_reduce_coalesced(grads: list[torch.Tensor], group):
    """Sum a list of gradients over `group` with one collective (flatten, reduce, copy back)."""
    if not grads or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _params(model_chunks: list[nn.Module]):
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.requires_grad:
                yield p


def allreduce_tp_partial_grads(model_chunks: list[nn.Module], tp_group, sequence_parallel: bool):
    """Step 2: sum over TP the grads of TP-replicated params that are partial on each TP rank:
    `sequence_parallel` params under SP (norm weights/biases, RowParallelLinear's bias: each TP rank
    sees only its slice of the sequence), and `grad_sum_over_tp` params (e.g. q/k layernorms, which
    see only their rank's heads) always. Expert params are not among them: the token dispatcher
    hands every expert-TP rank all the tokens of its experts, so a replicated expert param's
    gradient is whole on each (the router and shared experts are dense params and are summed)."""
    grads = [grad_of(p) for p in _params(model_chunks) if not is_expert_param(p) and (
             getattr(p, "grad_sum_over_tp", False)
             or (sequence_parallel and getattr(p, "sequence_parallel", False)))]
    _all_reduce_coalesced([g for g in grads if g is not None], tp_group)


def allreduce_embedding_grads(model_chunks: list[nn.Module], topology):
    """Step 3: sum the two tied-embedding copies' grads over the embedding group (PP > 1 only): the
    first stage's input embedding and the last stage's output layer (`param.shared_embedding`)
    then take the same step. With PP = 1 the weight is one tensor and nothing is done."""
    if topology.pp == 1 or not topology.is_in_embedding_group:
        return
    grads = [grad_of(p) for p in _params(model_chunks) if getattr(p, "shared_embedding", False)]
    _all_reduce_coalesced([g for g in grads if g is not None], topology.embedding_group())


def finalize_model_grads(model_chunks: list[nn.Module], *, topology, sequence_parallel: bool = False):
    """Run every cross-group gradient reduction of one step (see the module docstring).

    model_chunks: this rank's model chunks (one, or several with VPP); chunks wrapped in
    DistributedDataParallel get their DP buckets synchronised, plain modules skip step 1.

    Under the distributed optimizer step 1 leaves only this rank's shard of each bucket reduced;
    steps 2 and 3 then sum whole gradients, which is still right on the owned shard because TP
    peers have identical buffer layouts and every `shared_embedding` param has a bucket of its own,
    so the first and last stage shard it the same way. Under FSDP2 they sum the local shards: TP
    peers and the two embedding stages share a DP rank, so they hold the same rows of same-shaped
    tensors.
    """
    for chunk in model_chunks:
        if hasattr(chunk, "finish_grad_sync"):  # DDP, FSDP2
            chunk.finish_grad_sync()
    if topology.tp > 1:
        allreduce_tp_partial_grads(model_chunks, topology.group("tp"), sequence_parallel)
    allreduce_embedding_grads(model_chunks, topology)
