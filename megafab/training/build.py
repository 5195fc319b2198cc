"""Build what one rank trains with: topology, RNG, model chunks, DDP, optimizer, LR schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megafab.config.derive import fsdp_main_params_in_model_dtype, scheduler_samples
from megafab.config.moe import moe_settings
from megafab.distributed.data_parallel import DistributedDataParallel
from megafab.distributed.fsdp import (
    FullyShardedDataParallel,
    buffers_to_empty,
    data_parallel_mesh,
    expert_data_parallel_mesh,
    fill_shards,
    layer_units,
)
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import Topology, initialize
from megafab.errors import JobFault
from megafab.layout import rank_order
from megafab.model.fp8_params import quantized_init_context
from megafab.model.gpt import build_model_chunks
from megafab.model.te import check_transformer_engine, fp8_amax_group, fp8_recipe
from megafab.model.transformer import LayerContext
from megafab.optim.cpu_offload import OffloadConfig
from megafab.optim.distributed_optimizer import DistributedOptimizer
from megafab.optim.fully_sharded_optimizer import FullyShardedOptimizer
from megafab.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megafab.optim.lr_scheduler import OptimizerParamScheduler
from megafab.optim.mixed_precision import MixedPrecisionOptimizer
from megafab.pipeline_split import PipelineSplit
from megafab.run.launch import device_type, read_launch_env
from megafab.training.moe import moe_context_fields

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


@dataclass
class TrainState:
    cfg: object
    topology: Topology
    tracker: RNGStatesTracker
    model: list  # DistributedDataParallel (or FullyShardedDataParallel) chunks
    optimizer: MixedPrecisionOptimizer
    scheduler: OptimizerParamScheduler
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    consecutive_skipped: int = 0
    nan_iterations: int = 0
    num_floating_point_operations_so_far: float = 0.0  # Megatron's: across resumes, skipped iterations too
    extra: dict = field(default_factory=dict)


def init_distributed(cfg) -> tuple[Topology, RNGStatesTracker]:
    p = cfg.parallel
    check_transformer_engine(cfg.model, cfg.precision, planned_device(cfg))  # before any process group
    try:
        topo = initialize(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                          p.virtual_pipeline_model_parallel_size or 1, p.distributed_backend,
                          p.distributed_timeout_minutes, cp=p.context_parallel_size,
                          ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
                          order=rank_order(p.use_tp_pp_dp_mapping))
    except dist.DistError as e:  # before the process group exists no rank can speak for the job
        launch = read_launch_env()
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise JobFault(f"rank {launch.rank}: the {launch.world_size} ranks did not meet at "
                       f"{launch.master_addr}:{launch.master_port} within --distributed-timeout-minutes "
                       f"{p.distributed_timeout_minutes:g}: {first}; check that every rank was started "
                       f"and reaches that address (MASTER_ADDR/MASTER_PORT)") from None
    tracker = RNGStatesTracker(topo.device)
    model_parallel_seed(cfg.training.seed, topo.tp_rank, topo.pp_rank, topo.device, tracker,
                        cp_rank=topo.cp_rank)
    return topo, tracker


def planned_device(cfg) -> str:
    """The device initialize() will pick: CUDA when present, unless gloo was asked for."""
    return device_type(cfg.parallel.distributed_backend)


def params_dtype(cfg) -> torch.dtype:
    return DTYPES[cfg.precision.params_dtype_name]


def build_model(cfg, topo: Topology, tracker, dtype: torch.dtype | None = None) -> list:
    """This rank's model chunks, each wrapped for data parallelism (DDP, or FSDP2)."""
    dtype = dtype or params_dtype(cfg)
    if cfg.precision.bf16 and cfg.precision.disable_bf16_reduced_precision_matmul:
        # as megatron-core's TransformerConfig does: cuBLAS keeps bf16 GEMM reductions in fp32 (on CPU,
        # where the flag is still set, torch's bf16 matmul has no such reduced-precision path)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    ctx = LayerContext(topo.group("tp") if topo.tp > 1 else None, cfg.parallel.sequence_parallel, dtype,
                       topo.device, cfg.training.seed, tracker, precision=cfg.precision,
                       gradient_accumulation_fusion=cfg.parallel.gradient_accumulation_fusion,
                       cp_group=topo.group("cp") if topo.cp > 1 else None,
                       cp_comm_type=cfg.parallel.cp_comm_type,
                       fp8_group=fp8_amax_group(topo) if cfg.precision.fp8_format else None,
                       **{"calculate_per_token_loss": cfg.training.calculate_per_token_loss,  # MTP's, MoE's
                          **moe_context_fields(cfg, topo)})
    p = cfg.parallel
    # FSDP2 shards a meta-built chunk; the distributed optimizer places it in its param buffer.
    # Either then fills the values one part (layer) at a time: no second copy of the model. TE's
    # FP8 weights (--fp8-param-gather, built under TE's quantized init) are built in place instead.
    on_meta = (p.fully_sharded or p.use_distributed_optimizer) and not cfg.precision.fp8_param_gather
    with quantized_init_context(cfg.precision, fp8_recipe):
        chunks = build_model_chunks(cfg.model, ctx, topo.pp, topo.pp_rank,
                                    p.virtual_pipeline_model_parallel_size or 1,
                                    PipelineSplit.from_config(cfg), on_meta=on_meta)
    if p.fully_sharded:
        return [fully_shard_chunk(cfg, topo, c) for c in chunks]
    bucket = p.ddp_bucket_size if p.overlap_grad_reduce or p.use_distributed_optimizer else None
    # fp32 main grads (fp64 for fp64 models), or the bf16 params' own dtype (--grad-reduce-in-bf16)
    grad_dtype = None if p.accumulate_allreduce_grads_in_fp32 else dtype
    # Gradients are averaged (and the distributed optimizer shards) over DP x CP, as Megatron's.
    # Expert params (MoE) reduce and shard over expert-DP instead (megatron-core's expert buffers).
    expert_dp = topo.group("edp") if moe_settings(cfg) is not None else None
    wrapped = [DistributedDataParallel(c, dp_group=topo.group("dp", "cp"), bucket_size=bucket,
                                       expert_dp_group=expert_dp,
                                       grad_dtype=grad_dtype, overlap_grad_reduce=p.overlap_grad_reduce,
                                       use_distributed_optimizer=p.use_distributed_optimizer,
                                       average_in_collective=p.ddp_average_in_collective,
                                       device=topo.device)
               for c in chunks]
    if on_meta:
        for chunk in chunks:
            buffers_to_empty(chunk, topo.device)
            fill_shards(chunk, chunk.initialized_parts())
    return wrapped


def fully_shard_chunk(cfg, topo: Topology, chunk) -> FullyShardedDataParallel:
    """ZeRO-3 of one GPT chunk built on the meta device: FSDP2 units per transformer layer's
    attention block, MLP and norms (layer_units), the chunk the root unit (embedding, final norm,
    output layer); each rank's shards are filled one
    part at a time. The shards are the fp32 masters of a bf16/fp16 model, unless the optimizer is
    offloaded (then the host keeps the masters) or --megatron-fsdp-main-params-dtype says the
    model's own weights."""
    dtype = next(chunk.parameters()).dtype
    low_precision = dtype in (torch.bfloat16, torch.float16)
    own = cfg.optimizer.optimizer_cpu_offload or fsdp_main_params_in_model_dtype(cfg.parallel)
    # TE's FP8 weights shard as FP8 beside the others in one FSDP2 group, which takes one dtype: the
    # other shards stay in the model dtype too, the optimizer keeps fp32 copies (--fp8-param-gather)
    own = own or cfg.precision.fp8_param_gather
    main = torch.float32 if low_precision and not own else dtype
    reduce = None if cfg.parallel.accumulate_allreduce_grads_in_fp32 else dtype  # --grad-reduce-in-bf16
    expert_mesh = expert_data_parallel_mesh(topo) if moe_settings(cfg) is not None else None
    return FullyShardedDataParallel(chunk, mesh=data_parallel_mesh(topo), expert_mesh=expert_mesh,
                                    units=layer_units(chunk.decoder.layers.values()), main_dtype=main,
                                    reshard_after_forward=cfg.parallel.fsdp_reshard_after_forward,
                                    reduce_dtype=reduce, device=topo.device,
                                    initialized_parts=chunk.initialized_parts)


def build_optimizer(cfg, topo: Topology, model: list):
    o, pr = cfg.optimizer, cfg.precision
    scaler = None
    if pr.fp16:
        scaler = ConstantGradScaler(pr.loss_scale) if pr.loss_scale else DynamicGradScaler(
            initial_scale=pr.initial_loss_scale, min_scale=pr.min_loss_scale,
            growth_interval=pr.loss_scale_window, hysteresis=pr.hysteresis)
    kwargs = dict(topology=topo, lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                  eps=o.adam_eps, clip_grad=o.clip_grad, grad_scaler=scaler,
                  log_num_zeros_in_grad=cfg.logging.log_num_zeros_in_grad, raise_on_non_finite=False,
                  optimizer=o.optimizer, sgd_momentum=o.sgd_momentum, decoupled_lr=o.decoupled_lr,
                  decoupled_min_lr=o.decoupled_min_lr)
    if o.optimizer_cpu_offload:
        kwargs["cpu_offload"] = OffloadConfig(o.optimizer_offload_fraction, o.pin_cpu_grads, o.pin_cpu_params)
    if cfg.parallel.fully_sharded:
        return FullyShardedOptimizer(model, low_precision_main=fsdp_main_params_in_model_dtype(cfg.parallel),
                                     **kwargs)
    if cfg.parallel.use_distributed_optimizer:
        return DistributedOptimizer(model, overlap_param_gather=cfg.parallel.overlap_param_gather, **kwargs)
    return MixedPrecisionOptimizer(model, **kwargs)


def build_scheduler(cfg, optimizer) -> OptimizerParamScheduler:
    """Megatron counts the schedule in samples; iteration flags are converted with the batch size."""
    o = cfg.optimizer
    return OptimizerParamScheduler(
        optimizer, max_lr=o.lr, min_lr=o.min_lr, lr_decay_style=o.lr_decay_style,
        lr_warmup_init=o.lr_warmup_init, lr_wsd_decay_style=o.lr_wsd_decay_style, start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        **scheduler_samples(o, cfg.training))
