"""Bytes of training state per rank (weights, gradients, optimizer state; device and host) for every
data-parallel engine, from the config alone: DDP, Megatron's distributed optimizer, FSDP2 (ZeRO-3)
and optimizer CPU offload, as megafab lays them out (state_bytes writes the table out), plus the
transients on top of that state at rest: FSDP2's held root and largest unsharded-gradient moment
(fsdp_moments), the distributed optimizer's all-gather inputs after the step. The planner
(megafab.plan.planner) adds them to its stage rows; benchmarks/memory.py and tests measure them
against the real tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from megafab.config.derive import fsdp_main_params_in_model_dtype

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class StateBytes:
    weights: int
    grads: int
    optimizer: int  # on the device
    host: int  # optimizer CPU offload's host memory
    fsdp_held: int  # FSDP2: the root's gathered weights and unsharded grads through backward
    fsdp_transient: int  # FSDP2: the largest unsharded-gradient moment on top (fsdp_moments)
    gather_transient: int = 0  # the distributed optimizer's all-gather input copies
    staging: int = 0  # --async-save's host copies of what the rank writes (also in `host`)


def grad_bytes(cfg) -> int:
    """Bytes per element of the gradients data parallel accumulates and reduces (megafab.training.build:
    DDP's grad buffer, FSDP2's reduce dtype): fp32 main grads (fp64 for an fp64 model), or the model
    dtype with --grad-reduce-in-bf16."""
    e = BYTES[cfg.precision.params_dtype_name]
    return max(4, e) if cfg.parallel.accumulate_allreduce_grads_in_fp32 else e


def fsdp_moments(cfg, largest_unit: int, embedding: int) -> dict[str, int]:
    """FSDP2's candidate moments on top of its held root, named as the planner
    reports the peak: a unit's unsharded gradient and its flat reduce-scatter copy, 8 U; the end of
    backward's embedding gradient, 4 E, and with a tied output layer its sum into that, 8 E.

    FSDP2's working set, not at rest (megafab.distributed.fsdp: one unit per attention block, MLP
    and layer's norms; the root unit holds the embedding, final norm and output layer):
      `fsdp_held`, through the whole backward: the root's gathered weights and unsharded gradient,
      (e + 4) R (R = the root's parameters: the tied output layer's backward comes first, the
      embedding's last); with more than one micro-batch the unsharded fp32 gradients of all units
      accumulate between micro-batches (gradient accumulation without communication), 4 P instead
      of 4 R; without resharding after forward (ZeRO-2's communication) all gathered weights stay
      from forward to backward, + e P.
      `fsdp_transient`, the largest moment on top: a unit's unsharded gradient and FSDP2's flat
      reduce-scatter copy of it, 8 U (U = the largest unit below the root: a layer's MLP; its
      gather, 2 e U, the flat all-gather output and the per-parameter copy, is no larger), or at the
      end of backward the embedding's gradient E (word embedding on the rank) and, tied, its sum into
      the output layer's: 8 E (untied 4 E). It and the activations are counted as one max: the
      gradient shards (in the state at rest) are freed at the step's start and made again unit by
      unit as backward frees the activations.
    """
    tied = not cfg.model.untie_embeddings_and_output_weights
    return {"a unit's unsharded grad and its reduce-scatter copy (backward)": 8 * largest_unit,
            "the embedding's grad (and its sum into the tied output layer's) at the end of backward":
                (8 if tied else 4) * embedding}


def state_bytes(cfg, params: int, largest_unit: int, root: int = 0, embedding: int = 0,
                group_size: int | None = None) -> StateBytes:
    """StateBytes of a stage with `params` parameters whose largest FSDP2 unit below the root has
    `largest_unit`; root: the root units' parameters; embedding: the word-embedding parameters
    among them; group_size: the group they are reduced and sharded over, d (default DP x CP; MoE
    expert params: expert-DP).

    P = parameters of the rank's stage (on its TP rank), d = DP x CP size (the sharding group), e =
    bytes of the model dtype, m = bytes of a main param (4; 8 for fp64 models), f =
    --optimizer-offload-fraction (0 without offload), mixed = bf16/fp16:

                          weights      grads        optimizer (device)              host (offload)
      DDP                 e P          g P          (1-f) (12 | 8) P                f (16 | 18) P
      dist. optimizer     e P          g P          (1-f) (12 | 8) P / d            f (16 | 18) P / d
      FSDP2 (ZeRO-3)      m P / d      m P / d      8 P / d                         -
      FSDP2, 16-bit main  e P / d      e P / d      2 e P / d                       -
      (--megatron-fsdp-main-params-dtype auto: the 16-bit shards are the mains, Adam in their dtype)
      FSDP2 + offload     e P / d      e P / d      (1-f) (12 | 8) P / d            f (16 | 20) P / d

    Optimizer on the device: fp32 master 4 (mixed only: fp32 models step their own weights) + Adam
    exp_avg 4 + exp_avg_sq 4. Grads: g = grad_bytes, DDP's buffer (fp32 main grads; the model dtype
    with --grad-reduce-in-bf16), not sharded even under the distributed optimizer (Megatron's layout);
    FSDP2's gradient shards are in the shards' dtype. FSDP2 without offload keeps the fp32 masters *as*
    its shards: 16/d for a bf16 model, ZeRO-3's 16/d.
    Host per offloaded element: fp32 main 4 + Adam 8 + fp32 grad buffer 4, + e for the D2H landing
    buffer when the device grad is 16-bit (FSDP2, --grad-reduce-in-bf16) and + e for the H2D staging of a
    16-bit model (megafab.optim.cpu_offload); fp32 models need neither (16); (16 | 18 | 20) read
    (fp32 model | 16-bit model, fp32 device grads | 16-bit model and grads).

    The distributed optimizer's parameter all-gather (`gather_transient`): the input copy of this
    rank's shard of every bucket, e P / d, alive from the end of the optimizer step to the gather's
    wait (after backward: the activations are gone by then).

    --async-save stages what a rank writes in host memory, kept between saves (`staging`, counted in
    `host` too): its 1/d of the weights (e) and, unless --no-save-optim, of the main params (mixed)
    and Adam's moments, (e + (m | 0) + 2m) P / d, whichever engine.
    """
    p, o, pr = cfg.parallel, cfg.optimizer, cfg.precision
    dp = group_size or (p.data_parallel_size or 1) * p.context_parallel_size  # shards over DP x CP
    e = BYTES[pr.params_dtype_name]
    mixed = pr.bf16 or pr.fp16
    main = 8 if pr.params_dtype_name == "float64" else 4
    offload = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0
    adam = 2 * main
    shards = dp if p.fully_sharded or p.use_distributed_optimizer else 1
    if p.fully_sharded and not o.optimizer_cpu_offload:  # the shards are the masters
        if mixed and fsdp_main_params_in_model_dtype(p):
            main, adam, mixed = e, 2 * e, False  # no master copy: the 16-bit shards are stepped
        weights = grads = main * params / dp
        optimizer, host = adam * params / dp, 0
    else:
        weights = (e if not p.fully_sharded else e / dp) * params
        grads = (grad_bytes(cfg) if not p.fully_sharded else e / dp) * params
        optimizer = (1 - offload) * (adam + (main if mixed else 0)) * params / shards
        sixteen_bit_grads = mixed and (p.fully_sharded or grad_bytes(cfg) < main)
        host_per_element = main + adam + main + (e if sixteen_bit_grads else 0) + (e if mixed else 0)
        host = offload * host_per_element * params / shards
    held = transient = gather = 0
    if p.fully_sharded:
        accumulating = (cfg.training.num_micro_batches or 1) > 1
        held = e * root + 4 * (params if accumulating else root)
        if not p.fsdp_reshard_after_forward:
            held += e * params
        transient = max(fsdp_moments(cfg, largest_unit, embedding).values())
    elif p.use_distributed_optimizer and dp > 1:
        gather = e * params / dp
    staging = 0
    if cfg.checkpoint.async_save:
        staging = (e + (0 if cfg.checkpoint.no_save_optim else (main if mixed else 0) + adam)) * params / dp
    return StateBytes(int(weights), int(grads), int(optimizer), int(host + staging), int(held),
                      int(transient), int(gather), int(staging))
