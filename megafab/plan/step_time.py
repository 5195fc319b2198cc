"""One training iteration's time, from the FLOPs and bytes of a finalized Config on a Machine.

Per micro-batch, each pipeline stage's forward and backward: its layers' passes (layer_time.py),
the embedding on the first stage, the output layer and loss on the last; FSDP2's exposed unit work
(fsdp_stages); the machine's host work (host_terms: a CPU profile's, none on a GPU).
Per step: the pipeline schedule over m micro-batches (the host's: schedule.py's closed form, or a
CPU's shared cores run through time); the data-parallel reductions (data_parallel_seconds) or
FSDP2's reducing micro-batch; the step's small collectives (step_syncs.py); the optimizer
(optimizer_seconds); the host's per-step work. A CPU profile's host also stretches compute by the
ranks sharing its cores (host_terms.host_model is this module's one view of the machine's host).

Throughput is reported as Megatron does: model FLOPs (megafab.plan.flops, no recompute) per
second per GPU, and MFU = that / the machine's peak for the model dtype.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from megafab.pipeline_split import PipelineSplit
from megafab.plan import fsdp
from megafab.plan.collectives import STEP_SUFFIX, collective_seconds, group_placement, p2p_seconds
from megafab.plan.flops import flops_per_iteration
from megafab.plan.host_terms import host_model
from megafab.plan.layer_time import (
    Pass,
    Shapes,
    cached_layer_passes,
    embedding_pass,
    layer_passes,
    output_pass,
    recomputed_layers,
)
from megafab.plan.moe import expert_data_parallel_size, expert_sizes, is_moe_layer
from megafab.plan.planner import chunk_params, fsdp_layer_units
from megafab.plan.state_memory import BYTES, grad_bytes
from megafab.plan.step_syncs import step_sync_seconds

__all__ = ["Prediction", "data_parallel_seconds", "fsdp_stages", "layer_passes", "optimizer_seconds",
           "predict", "stage_passes"]


@dataclass
class Prediction:
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per part of the step


def _stage_layers(cfg) -> list[list[list[tuple[int, bool]]]]:
    """Per pipeline stage, per model chunk, its layers as (global index, recomputed in backward)."""
    split = PipelineSplit.from_config(cfg)
    out = []
    for rank, chunks in enumerate(split.counts()):
        stage = []
        for chunk, n in enumerate(chunks):
            start, end = split.layer_range(rank, chunk)
            recomputed = start + recomputed_layers(cfg, n)  # block: the chunk's first n
            stage.append([(index, index < recomputed) for index in range(start, end)])
        out.append(stage)
    return out


class _Parts(NamedTuple):
    """What the stages' passes, FSDP2's timeline and the host share."""
    shapes: Shapes
    kinds: dict[bool, tuple[Pass, Pass]]  # {is an MoE layer: (forward, backward) of one such layer}
    embedding: tuple[Pass, Pass]
    output: tuple[Pass, Pass]
    layers: list[list[list[tuple[int, bool]]]]  # _stage_layers
    moe_layers: list[bool]  # each layer's kind
    mtp: tuple[Pass, Pass] = (Pass(), Pass())  # the MTP depths, on the last stage


def _parts(cfg, machine, tp_comm_overlap: bool, memo: dict | None) -> _Parts:
    x = Shapes(cfg, machine)
    kinds = {False: cached_layer_passes(cfg, machine, x, tp_comm_overlap, memo, False)}
    if x.moe is not None:
        kinds[True] = cached_layer_passes(cfg, machine, x, tp_comm_overlap, memo, True)
    moe_layers = [is_moe_layer(x.moe, i) for i in range(cfg.model.num_layers)]
    embedding, output = embedding_pass(x), output_pass(x, tp_comm_overlap)
    return _Parts(x, kinds, embedding, output, _stage_layers(cfg), moe_layers,
                  _mtp_passes(x, kinds[moe_layers[-1]], output, embedding))


def _mtp_passes(x: Shapes, layer, output, embedding) -> tuple[Pass, Pass]:
    """All multi-token prediction depths of a micro-batch (model/mtp.py): each its embedding,
    eh_proj's GEMMs (2h -> h/t), a layer of the decoder's last layer's kind, the output layer and loss."""
    depths = x.cfg.model.mtp_num_layers or 0
    if not depths:
        return Pass(), Pass()
    wide, out = 2 * x.h, x.h // x.tp
    fwd = embedding[0] + layer[0] + output[0] + Pass(gemm=x.gemm(x.M, out, wide))
    bwd = embedding[1] + layer[1] + output[1] + Pass(gemm=x.gemm(x.M, wide, out) + x.gemm(wide, out, x.M))
    return fwd.scaled(depths), bwd.scaled(depths)


def stage_passes(cfg, machine, tp_comm_overlap: bool = False,
                 memo: dict | None = None) -> list[tuple[Pass, Pass]]:
    """(forward, backward) of one micro-batch through each pipeline stage (all its chunks). memo: a
    dict kept by a caller that predicts many layouts of one model on one machine."""
    return _stage_passes(_parts(cfg, machine, tp_comm_overlap, memo))


def _stage_passes(parts: _Parts) -> list[tuple[Pass, Pass]]:
    out = []
    for rank, chunks in enumerate(parts.layers):
        fwd, bwd = Pass(), Pass()
        for index, recomputed in itertools.chain.from_iterable(chunks):
            layer_f, layer_b = parts.kinds[parts.moe_layers[index]]
            fwd, bwd = fwd + layer_f, bwd + layer_b + (layer_f if recomputed else Pass())
        if rank == 0:
            fwd, bwd = fwd + parts.embedding[0], bwd + parts.embedding[1]
        if rank == len(parts.layers) - 1:
            fwd, bwd = fwd + parts.output[0] + parts.mtp[0], bwd + parts.output[1] + parts.mtp[1]
        out.append((fwd, bwd))
    return out


def _buckets(cfg, params: int) -> int:
    size = cfg.parallel.ddp_bucket_size
    return max(1, math.ceil(params / size)) if size else 1


def _hidden(comm: float, cover: float, buckets: int) -> float:
    """Exposed part of a bucketed reduction overlapped with `cover` seconds of compute: the last
    bucket always waits."""
    return max(comm / buckets, comm - cover)


def _groups(cfg, machine, stage):
    """[(parameters, their reduction group)] of a stage: the dense ones over DP x CP, an MoE model's
    routed experts over expert-DP."""
    groups = [(stage.params - stage.expert_params, group_placement(cfg, machine, "dp", "cp"))]
    if stage.expert_params:
        groups.append((stage.expert_params, group_placement(cfg, machine, "edp")))
    return [(n, where) for n, where in groups if where.size > 1 and n > 0]


def _over(machine, op: str, bytes_per_param: float, groups) -> float:
    """One collective of each group's parameters, in turn (the once-a-step reduction's price)."""
    return sum(collective_seconds(machine, op, bytes_per_param * n, where, STEP_SUFFIX)
               for n, where in groups)


def data_parallel_seconds(cfg, machine, stages, passes) -> float:
    """Exposed gradient reduction + parameter gather per step (DDP and the distributed optimizer;
    FSDP2's are fsdp_stages'): the dense parameters over the dp-cp group, an MoE model's routed
    experts over expert-DP (all-reduce, or reduce-scatter + parameter all-gather with the
    distributed optimizer; both hide behind the same backward), hidden by --overlap-grad-reduce
    behind the last micro-batch's backward and by --overlap-param-gather behind the first one's
    forward, except one bucket."""
    p = cfg.parallel
    if p.fully_sharded or not any(_groups(cfg, machine, stage) for stage in stages):
        return 0.0
    e = BYTES[cfg.precision.params_dtype_name]
    grad_e = grad_bytes(cfg)
    worst = 0.0
    for i, (stage, (fwd, bwd)) in enumerate(zip(stages, passes)):
        groups = _groups(cfg, machine, stage)
        slack = i * bwd.total  # later stages finish their last backward earlier (1F1B drain)
        buckets = _buckets(cfg, stage.params)
        if p.use_distributed_optimizer:
            reduce = _over(machine, "reduce_scatter", grad_e, groups)
            gather = _over(machine, "all_gather", e, groups)
        else:
            reduce = _over(machine, "all_reduce", grad_e, groups)
            gather = 0.0
        exposed = _hidden(reduce, bwd.total, buckets) if p.overlap_grad_reduce else reduce
        exposed += _hidden(gather, fwd.total, buckets) if p.overlap_param_gather else gather
        worst = max(worst, exposed - slack)
    return max(worst, 0.0)


def fsdp_stages(cfg, machine, parts: _Parts, shared: float) -> list[fsdp.StageFsdp]:
    """FSDP2's exposed time on each pipeline stage (megafab.plan.fsdp): each unit's gathers,
    reduce-scatters and copies against its own layer's compute (stretched by `shared`, the host's
    compute scale); what every micro-batch exposes goes into its stage's time in the schedule, the
    reducing micro-batch's extra after it. Never with Transformer Engine's TP overlap (megafab runs
    FSDP2 without TE)."""
    x, kinds, _, output, layers, moe_layers, _ = parts
    m = cfg.model
    ep, etp = expert_sizes(cfg)
    timed: dict[tuple[bool, bool], fsdp.Layer] = {}  # (MoE layer, recomputed): every such layer's

    def layer(index: int, recomputed: bool) -> fsdp.Layer:
        moe_layer = moe_layers[index]
        if (moe_layer, recomputed) not in timed:
            f, b = kinds[moe_layer]
            f = f.compute_scaled(shared).total
            backward = b.compute_scaled(shared).total + (f if recomputed else 0.0)
            units = fsdp.groups(cfg, machine, fsdp_layer_units(cfg, index, x.tp, etp, ep))
            timed[moe_layer, recomputed] = fsdp.Layer(units, f, backward)
        return timed[moe_layer, recomputed]

    output_cover = output[1].compute_scaled(shared).total
    accumulating = (cfg.training.num_micro_batches or 1) > 1
    out = []
    for rank, chunks in enumerate(layers):
        last_stage = rank == len(layers) - 1
        stage = []
        for c, chunk in enumerate(chunks):
            root = chunk_params(m, x.tp, 0, rank == 0 and c == 0, last_stage and c == len(chunks) - 1)
            stage.append((fsdp.unit(cfg, machine, root), [layer(i, recomputed) for i, recomputed in chunk]))
        out.append(fsdp.stage_seconds(cfg, stage, output_cover if last_stage else 0.0, accumulating))
    return out


def optimizer_seconds(cfg, machine, stages) -> float:
    """Adam over this rank's shard, memory-bound (bytes of state / HBM bandwidth): fp32 main params,
    grads, m, v read and written, the 16-bit copy written, the gradient norm read; offloaded, PCIe
    both ways and the CPU's Adam."""
    p, o = cfg.parallel, cfg.optimizer
    sharded = p.use_distributed_optimizer or p.fully_sharded
    shards = (p.data_parallel_size or 1) * p.context_parallel_size if sharded else 1
    expert_shards = expert_data_parallel_size(cfg) if sharded else 1
    shard = max((s.params - s.expert_params) / shards + s.expert_params / expert_shards for s in stages)
    e = BYTES[cfg.precision.params_dtype_name]
    offload = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0
    device = machine.memory_seconds((1 - offload) * shard * (8 + 4 + 16 + e + 4), kernels=8)
    host = 0.0
    if offload:
        moved = offload * shard
        host = moved * (4 + e) / machine.pcie_bandwidth + moved / machine.host_adam_params_per_s
    return device + host


def _fsdp_step_seconds(sharded: list[fsdp.StageFsdp], passes) -> float:
    """FSDP2's once-a-step exposed time: the reducing micro-batch's backward runs through the stages
    in turn; each stage's tail hides behind the backward still to come on the stages before it
    (1F1B drain)."""
    return sum(s.reducing for s in sharded) + max(
        0.0, max(s.tail - i * b.total for i, (s, (_, b)) in enumerate(zip(sharded, passes))))


def predict(cfg, machine, stages, tp_comm_overlap: bool = False, memo: dict | None = None) -> Prediction:
    """Step time of the finalized cfg whose memory plan is `stages` (megafab.plan.planner.plan);
    memo: see stage_passes."""
    p, t = cfg.parallel, cfg.training
    # TE's userbuffers TP overlap (what tp_comm_overlap assumes; --tp-comm-overlap is refused) is not
    # modelled beside FSDP2's gathers: an FSDP2 layout is estimated without it
    parts = _parts(cfg, machine, tp_comm_overlap and not p.fully_sharded, memo)
    host = host_model(cfg, machine, parts.layers)
    alone = _stage_passes(parts)
    passes = [(f.compute_scaled(host.scale), b.compute_scaled(host.scale)) for f, b in alone]
    sharded = fsdp_stages(cfg, machine, parts, host.scale) if p.fully_sharded else None
    fsdp_mb = [s.per_micro_batch for s in sharded] if sharded else [0.0] * len(passes)
    seconds = [f.total + b.total + g + h for (f, b), g, h in zip(passes, fsdp_mb, host.micro_batch)]
    x = parts.shapes
    boundary = x.e * x.M * x.h / (x.tp if x.sp else 1)
    p2p = p2p_seconds(machine, boundary, group_placement(cfg, machine, "pp"))
    pipe = host.pipeline(seconds, alone, fsdp_mb, p2p)
    if sharded:
        dp = _fsdp_step_seconds(sharded, passes)
    else:
        dp = data_parallel_seconds(cfg, machine, stages, passes)
    opt = optimizer_seconds(cfg, machine, stages) * host.scale
    syncs = step_sync_seconds(cfg, machine)
    step = pipe.total + dp + syncs + opt + host.step
    slowest = max(range(len(passes)), key=lambda i: seconds[i])
    m_count = t.num_micro_batches or 1
    f, b = passes[slowest]
    kernels = (f + b).scaled(m_count)
    breakdown = {"gemm": kernels.gemm, "attention": kernels.attention, "memory_bound": kernels.memory,
                 "tp_comm": kernels.tp, "cp_comm": kernels.cp, "ep_comm": kernels.ep,
                 "pp_bubble": pipe.bubble, "pp_p2p": pipe.p2p, "dp_comm": dp, "step_syncs": syncs,
                 "fsdp_gather": m_count * fsdp_mb[slowest], "optimizer": opt,
                 "host_micro_batches": m_count * host.micro_batch[slowest], "overhead": host.step}
    tflops = flops_per_iteration(cfg, t.global_batch_size) / p.world_size / step / 1e12
    peak = machine.peak(cfg.precision.params_dtype_name) / 1e12
    tokens = t.global_batch_size * cfg.model.seq_length / step
    return Prediction(step, tokens, tflops, tflops / peak if peak else 0.0, breakdown)
