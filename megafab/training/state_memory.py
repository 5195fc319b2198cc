"""Bytes of training state per rank (weights, gradients, optimizer state; device and host) for every
data-parallel engine, from the config alone. The planner (megafab.training.planner) adds them to
its stage rows; benchmarks/memory.py and tests measure them against the real tensors.

P = parameters of the rank's stage (on its TP rank), d = DP x CP size (the sharding group), e =
bytes of the model dtype, m = bytes of a main param (4; 8 for fp64 models), f =
--optimizer-offload-fraction (0 without offload), mixed = bf16/fp16:

                      weights      grads        optimizer (device)              host (offload)
  DDP                 e P          4 P          (1-f) (12 | 8) P                f (16 | 18) P
  dist. optimizer     e P          4 P          (1-f) (12 | 8) P / d            f (16 | 18) P / d
  FSDP2 (ZeRO-3)      m P / d      m P / d      8 P / d                         -
  FSDP2 + offload     e P / d      e P / d      (1-f) (12 | 8) P / d            f (16 | 20) P / d

Optimizer on the device: fp32 master 4 (mixed only: fp32 models step their own weights) + Adam
exp_avg 4 + exp_avg_sq 4. Grads: DDP's fp32 buffer is not sharded even under the distributed
optimizer (Megatron's layout); FSDP2's gradient shards are in the shards' dtype. FSDP2 without
offload keeps the fp32 masters *as* its shards: 16/d for a bf16 model, ZeRO-3's 16/d.
Host per offloaded element: fp32 main 4 + Adam 8 + fp32 grad buffer 4, + e for the D2H landing
buffer when the device grad is 16-bit (FSDP2, plain bf16 grads) and + e for the H2D staging of a
16-bit model (megafab.optim.cpu_offload); fp32 models need neither (16); (16 | 18 | 20) read
(fp32 model | 16-bit model, fp32 device grads | 16-bit model and grads).

FSDP2's working set (`fsdp_transient`, not at rest): the gathered weights of the unit in use and
of the prefetched next one, 2 e U (U = the largest unit: a layer, or the root's embedding, final
norm and output layer), the unsharded gradient of a unit, 4 U, and the flat copy of it FSDP2
reduce-scatters, 4 U (on gloo, which copies a reduce-scatter's input, once more 4 U); with more
than one micro-batch the unsharded fp32 gradients of all units accumulate between micro-batches
(gradient accumulation without communication), 4 P; without resharding after forward (ZeRO-2's
communication) all gathered weights stay from forward to backward, e P.

The distributed optimizer's parameter all-gather (`gather_transient`): the input copy of this
rank's shard of every bucket, e P / d, alive from the end of the optimizer step to the gather's
wait (after backward: the activations are gone by then).
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class StateBytes:
    weights: int
    grads: int
    optimizer: int  # on the device
    host: int  # optimizer CPU offload's host memory
    fsdp_transient: int  # FSDP2's gathered weights and unsharded grads during forward/backward
    gather_transient: int = 0  # the distributed optimizer's all-gather input copies


def state_bytes(cfg, params: int, largest_unit: int, gloo: bool = False,
                group_size: int | None = None) -> StateBytes:
    """StateBytes of a stage with `params` parameters whose largest FSDP2 unit has `largest_unit`;
    gloo: the collectives run on gloo (CPU); group_size: the group they are reduced and sharded
    over, d (default DP x CP; MoE expert params: expert-DP)."""
    p, o, pr = cfg.parallel, cfg.optimizer, cfg.precision
    dp = group_size or (p.data_parallel_size or 1) * p.context_parallel_size  # shards over DP x CP
    e = BYTES[pr.params_dtype_name]
    mixed = pr.bf16 or pr.fp16
    main = 8 if pr.params_dtype_name == "float64" else 4
    offload = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0
    adam = 2 * main
    shards = dp if p.fully_sharded or p.use_distributed_optimizer else 1
    if p.fully_sharded and not o.optimizer_cpu_offload:  # the shards are the masters
        weights = grads = main * params / dp
        optimizer, host = adam * params / dp, 0
    else:
        weights = (e if not p.fully_sharded else e / dp) * params
        grads = (main if not p.fully_sharded else e / dp) * params
        optimizer = (1 - offload) * (adam + (main if mixed else 0)) * params / shards
        sixteen_bit_grads = mixed and p.fully_sharded
        host_per_element = main + adam + main + (e if sixteen_bit_grads else 0) + (e if mixed else 0)
        host = offload * host_per_element * params / shards
    transient = gather = 0
    if p.fully_sharded:
        accumulating = (cfg.training.num_micro_batches or 1) > 1
        reduce_scatter = 4 * largest_unit * (2 if gloo else 1)
        transient = 2 * e * largest_unit + 4 * (params if accumulating else largest_unit) + reduce_scatter
        if not p.fsdp_reshard_after_forward:
            transient += e * params
    elif p.use_distributed_optimizer and dp > 1:
        gather = e * params / dp
    return StateBytes(int(weights), int(grads), int(optimizer), int(host), int(transient), int(gather))
