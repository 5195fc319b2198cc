"""One training iteration's time, from the FLOPs and bytes of a finalized Config on a Machine.

Notation as megafab.plan.planner: s sequence, b micro-batch, h hidden, a heads, g query groups,
d head width, f ffn width, V padded vocab, t TP, c CP, e bytes per element; M = b s / c tokens per
rank in every GEMM (under SP the GEMMs run on the TP-gathered sequence).

Per layer and micro-batch, on one rank:
  GEMMs     forward QKV [M, h] x [h, (a+2g)d/t], projection [M, ad/t] x [ad/t, h], fc1 [M, h] x
            [h, f/t] (2f/t with SwiGLU), fc2 [M, f/t] x [f/t, h]; backward for each one the data
            gradient [M, n] x [n, k] and the weight gradient [k, M] x [M, n] (2x the forward).
  attention flash kernels doing the causal half of the 4 b s^2 (a/t) d / c forward FLOPs (the
            backward recomputes the scores: 2.5x), at the machine's attention efficiency.
  memory    norms, bias/dropout/residual adds, activation, RoPE: bytes over HBM (backward 2x).
  TP        with SP: forward 2 all-gathers + 2 reduce-scatters of e M h bytes; backward 2 + 2 more,
            and the SP input re-gathered for the weight gradient (2 all-gathers, which the linear
            layer overlaps with the data-gradient GEMM); without SP: 2 + 2 all-reduces.
            tp_comm_overlap (Transformer Engine's userbuffers, Megatron's --tp-comm-overlap)
            pipelines each collective with its GEMM in t chunks: one chunk stays exposed, and what
            the GEMM cannot cover.
  CP        p2p: c-1 K/V ring steps per layer, each hidden behind one attention block, backward
            sending dK/dV too; allgather: K/V gathered, their gradients reduce-scattered; a2a:
            q, k, v and the output re-sharded between sequence and heads.
  recompute full: the layer's forward again in backward (with its TP collectives); selective: the
            attention forward again.
  MoE       an MoE layer's MLP (megafab.plan.moe): the router [N, h] x [h, E], each local expert's
            fc1/fc2 on its share of the balanced routed rows (N k t_e / E_l), the shared experts as
            a dense MLP (with its TP pair of collectives; without shared experts the MLP has none);
            dispatch + combine: alltoall, 2 all-to-alls of e N k h over EP and the ETP all-gather /
            reduce-scatter of the rows; allgather, the EP x ETP group's tokens gathered and the
            outputs reduce-scattered; the same again in backward (not overlapped).
First stage: the embedding (memory-bound); last stage: final norm, output layer [M, h] x [h, V/t]
and the fp32 cross entropy over [M, V/t].

Per step: the pipeline schedule (schedule.py) over m micro-batches; the step's small collectives
after the backward (step_syncs.py: gradient norm, loss, SP and tied-embedding sums);
data-parallel reductions over the dp-cp group, and an MoE model's routed-expert parameters over
expert-DP (all-reduce, or reduce-scatter + parameter all-gather with the distributed optimizer), hidden by
--overlap-grad-reduce behind the last micro-batch's backward and by --overlap-param-gather behind
the first one's forward, except one bucket; FSDP2's per-unit gathers, reduce-scatters and copies
against each layer's own compute (megafab.plan.fsdp: what every micro-batch exposes goes into its
stage's time in the schedule, the reducing micro-batch's extra after it), without Transformer
Engine's TP overlap (megafab runs FSDP2 without TE); the optimizer step, memory-bound (bytes of
state / HBM bandwidth) and, offloaded, PCIe copies plus the CPU's Adam.

Host overhead (the machine's host_overheads; a measured CPU profile fits them from megafab's own
train_step, built-in GPU profiles have none): each stage per micro-batch its fixed cost in each
model chunk (VPP calls every chunk's forward and backward) plus one per layer and one more per
fully (or selectively) recomputed layer, in the stage's time in the schedule; per step
iteration_overhead_s plus the step's fixed cost plus one per parameter tensor the rank's optimizer
steps (param_tensors: DDP every tensor of its chunks, the distributed optimizer those its 1/DP
shard of megafab's own bucket layout touches, FSDP2 every tensor's dim-0 shard). Ranks sharing a CPU's
cores run their host work in turn too.

Throughput is reported as Megatron does: model FLOPs (megafab.plan.flops, no recompute) per
second per GPU, and MFU = that / the machine's peak for the model dtype.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from megafab.config.moe import moe_settings
from megafab.pipeline_split import PipelineSplit
from megafab.plan import fsdp
from megafab.plan.collectives import STEP_SUFFIX, collective_seconds, group_placement, p2p_seconds
from megafab.plan.flops import flops_per_iteration
from megafab.plan.moe import (
    expected_rows,
    expert_data_parallel_size,
    expert_sizes,
    is_moe_layer,
    router_tokens,
)
from megafab.plan.optimizer_tensors import param_tensors, sharding_name
from megafab.plan.planner import chunk_params, fsdp_layer_units
from megafab.plan.schedule import StagePass, pipeline_time, shared_pipeline_time
from megafab.plan.state_memory import BYTES, grad_bytes
from megafab.plan.step_syncs import step_sync_seconds


@dataclass
class Prediction:
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per part of the step


@dataclass
class _Pass:
    """Seconds of one forward or backward of one layer (or the embedding/output) for one micro-batch."""
    gemm: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0  # MoE token dispatch: EP all-to-all (or all-gather) and the ETP gather/scatter

    @property
    def compute(self) -> float:
        """What compute_scaled stretches: the kernels."""
        return self.gemm + self.attention + self.memory

    @property
    def comm(self) -> float:
        return self.tp + self.cp + self.ep

    @property
    def total(self) -> float:
        return self.compute + self.comm

    def __add__(self, other: _Pass) -> _Pass:
        return _Pass(self.gemm + other.gemm, self.attention + other.attention, self.memory + other.memory,
                     self.tp + other.tp, self.cp + other.cp, self.ep + other.ep)

    def compute_scaled(self, k: float) -> _Pass:
        return _Pass(self.gemm * k, self.attention * k, self.memory * k, self.tp, self.cp, self.ep)

    def scaled(self, k: float) -> _Pass:
        return _Pass(self.gemm * k, self.attention * k, self.memory * k, self.tp * k, self.cp * k,
                     self.ep * k)


class _Shapes:
    def __init__(self, cfg, machine):
        m, p, t = cfg.model, cfg.parallel, cfg.training
        self.cfg, self.machine = cfg, machine
        self.dtype = cfg.precision.params_dtype_name
        self.e = BYTES[self.dtype]
        self.tp, self.cp = p.tensor_model_parallel_size, p.context_parallel_size
        self.sp = p.sequence_parallel
        self.s, self.b, self.h = m.seq_length, t.micro_batch_size, m.hidden_size
        self.M = self.b * self.s // self.cp
        self.a, self.g, self.d, self.f = m.num_attention_heads, m.num_query_groups, m.kv_channels, \
            m.ffn_hidden_size
        self.tp_group = group_placement(cfg, machine, "tp")
        self.cp_group = group_placement(cfg, machine, "cp")
        self.moe = moe_settings(cfg)
        self.ep, self.etp = expert_sizes(cfg)
        self.f_s = 0
        if self.moe is not None:
            self.N = router_tokens(cfg)  # tokens entering one rank's router
            self.rows = expected_rows(cfg, self.moe)  # routed rows one rank's experts take (balanced)
            self.f_e = self.moe.ffn_hidden_size(self.f)
            self.f_s = self.moe.moe_shared_expert_intermediate_size or 0
            self.ep_group = group_placement(cfg, machine, "ep")
            self.etp_group = group_placement(cfg, machine, "etp")
            self.ep_etp_group = group_placement(cfg, machine, "etp", "ep")

    def gemm(self, m: int, n: int, k: int) -> float:
        return self.machine.gemm_seconds(m, n, k, self.dtype, self.e)

    def tp_collective(self, op: str, nbytes: float) -> float:
        return collective_seconds(self.machine, op, nbytes, self.tp_group)


def _mlp_shapes(x: _Shapes, rows: int, f: int, parts: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of fc1 and fc2 of an MLP of width f split `parts` ways, on `rows` rows."""
    fc1 = f * (2 if x.cfg.model.swiglu else 1)
    return [(rows, fc1 // parts, x.h), (rows, x.h, f // parts)]


def _linear_shapes(x: _Shapes, moe_layer: bool = False) -> list[tuple[int, int, int]]:
    """(m, n, k) of the layer's forward GEMMs on one TP rank: QKV, projection, then fc1 and fc2 of the
    dense MLP, or of an MoE layer's shared experts (if any), its router and each local expert."""
    attention = [(x.M, (x.a + 2 * x.g) * x.d // x.tp, x.h), (x.M, x.h, x.a * x.d // x.tp)]
    if not moe_layer:
        return attention + _mlp_shapes(x, x.M, x.f, x.tp)
    shared = _mlp_shapes(x, x.M, x.f_s, x.tp) if x.f_s else []
    local = x.moe.num_experts // x.ep
    experts = _mlp_shapes(x, x.rows // local, x.f_e, x.etp) * local
    return attention + shared + [(x.N, x.moe.num_experts, x.h)] + experts


def _elementwise_bytes(x: _Shapes, moe_layer: bool = False) -> float:
    """Forward bytes of the layer's memory-bound kernels on one rank; an MoE layer's activation runs
    on its routed rows and shared experts, plus the router's softmax/top-k over [N, E] in fp32 and
    the permutation of the N k routed copies in dispatch and combine (read and written)."""
    m = x.cfg.model
    tokens = x.M / (x.tp if x.sp else 1)  # the norm/dropout region is sequence-sharded under SP
    mask = 1 if m.hidden_dropout > 0 else 0
    norms = 2 * 2 * x.e * tokens * x.h
    residual_adds = 2 * (3 * x.e + mask) * tokens * x.h
    act = (3 if m.swiglu else 2) * x.e
    if moe_layer:
        copies = x.N * x.moe.moe_router_topk
        activation = act * (x.rows * x.f_e / x.etp + x.M * x.f_s / x.tp) \
            + 4 * 4 * x.N * x.moe.num_experts + 2 * 2 * x.e * copies * x.h
    else:
        activation = act * x.M * x.f / x.tp
    rope = 2 * x.e * x.M * (x.a + x.g) * x.d / x.tp if m.position_embedding_type == "rope" else 0
    return norms + residual_adds + activation + rope


def _overlapped(comm: float, gemm: float, chunks: int) -> float:
    """What stays exposed of a collective pipelined with a GEMM in `chunks` pieces."""
    return max(comm / chunks, comm - gemm * (chunks - 1) / chunks)


def _tp_comm(x: _Shapes, gemms_fwd: list[float], gemms_dgrad: list[float],
             overlap: bool, mlp: bool = True) -> tuple[float, float]:
    """(forward, backward) exposed TP/SP collectives of one layer; mlp: the MLP's pair too (an MoE
    layer has it only for its shared experts: the routed tokens travel by the dispatcher)."""
    if x.tp == 1:
        return 0.0, 0.0
    size = x.e * x.M * x.h
    pairs = 2 if mlp else 1
    if not x.sp:
        ar = x.tp_collective("all_reduce", size)
        return pairs * ar, pairs * ar
    ag, rs = x.tp_collective("all_gather", size), x.tp_collective("reduce_scatter", size)
    # forward: AG before QKV and fc1, RS after projection and fc2
    # backward: RS of the QKV/fc1 input gradients, AG of the projection/fc2 output gradients, and
    # the SP input re-gathered for the QKV/fc1 weight gradients behind their data-gradient GEMMs
    qkv, proj, fc1, fc2 = gemms_fwd[:4] if mlp else gemms_fwd[:2] + [0.0, 0.0]
    d_qkv, d_proj, d_fc1, d_fc2 = gemms_dgrad[:4] if mlp else gemms_dgrad[:2] + [0.0, 0.0]
    regather = max(0.0, ag - d_qkv) + (max(0.0, ag - d_fc1) if mlp else 0.0)
    if not overlap:
        return pairs * (ag + rs), pairs * (rs + ag) + regather
    t = x.tp
    fwd = _overlapped(ag, qkv, t) + _overlapped(rs, proj, t)
    bwd = _overlapped(rs, d_qkv, t) + _overlapped(ag, d_proj, t) + regather
    if mlp:
        fwd += _overlapped(ag, fc1, t) + _overlapped(rs, fc2, t)
        bwd += _overlapped(rs, d_fc1, t) + _overlapped(ag, d_fc2, t)
    return fwd, bwd


def _ep_comm(x: _Shapes) -> float:
    """One MoE layer's token dispatch and combine, forward (backward moves the same bytes back):
    alltoall, 2 all-to-alls over EP of the N k routed copies and, ETP > 1, the ETP all-gather and
    reduce-scatter of the rows; allgather, the EP x ETP group's tokens (and their fp32
    probabilities) gathered and the outputs reduce-scattered."""
    copies = x.N * x.moe.moe_router_topk
    if x.moe.moe_token_dispatcher_type == "alltoall":
        a2a = collective_seconds(x.machine, "all_to_all", x.e * copies * x.h, x.ep_group)
        rows = x.e * x.rows * x.h
        return 2 * a2a + collective_seconds(x.machine, "all_gather", rows, x.etp_group) \
            + collective_seconds(x.machine, "reduce_scatter", rows, x.etp_group)
    gathered = x.N * x.ep * x.etp
    nbytes = gathered * (x.e * x.h + 4 * x.moe.num_experts)
    return collective_seconds(x.machine, "all_gather", nbytes, x.ep_etp_group) \
        + collective_seconds(x.machine, "reduce_scatter", x.e * gathered * x.h, x.ep_etp_group)


def _cp_comm(x: _Shapes, attention_fwd: float, attention_bwd: float) -> tuple[float, float]:
    if x.cp == 1:
        return 0.0, 0.0
    p = x.cfg.parallel
    kv = 2 * x.e * x.M * x.g * x.d / x.tp  # this rank's K and V
    if p.cp_comm_type == "p2p":
        steps = x.cp - 1
        send = p2p_seconds(x.machine, kv, x.cp_group)
        send_bwd = p2p_seconds(x.machine, kv + 2 * kv * 4 / x.e, x.cp_group)  # + fp32 dK/dV
        return (steps * max(0.0, send - attention_fwd / x.cp),
                steps * max(0.0, send_bwd - attention_bwd / x.cp))
    if p.cp_comm_type == "allgather":
        fwd = collective_seconds(x.machine, "all_gather", kv * x.cp, x.cp_group)
        return fwd, fwd + collective_seconds(x.machine, "reduce_scatter", kv * x.cp * 4 / x.e, x.cp_group)
    qkv_out = x.e * x.M * ((x.a + 2 * x.g) + x.a) * x.d / x.tp * x.cp  # a2a: full-size q, k, v and output
    a2a = collective_seconds(x.machine, "all_to_all", qkv_out, x.cp_group)
    return a2a, a2a


def layer_passes(cfg, machine, tp_comm_overlap: bool = False, moe_layer: bool = False) -> tuple[_Pass, _Pass]:
    """(forward, backward incl. recompute) of one transformer layer for one micro-batch on one rank;
    moe_layer: one with an MoE MLP."""
    x = _Shapes(cfg, machine)
    m = cfg.model
    shapes = _linear_shapes(x, moe_layer)
    fwd_g = [x.gemm(*s) for s in shapes]
    dgrad = [x.gemm(mm, k, n) for mm, n, k in shapes]
    wgrad = [x.gemm(k, n, mm) for mm, n, k in shapes]
    heads = x.a // x.tp
    causal_flops = 4 * heads * x.d * x.M * x.s / 2  # M = b s / c queries, each meeting half the keys
    keys = x.s if cfg.parallel.cp_comm_type == "a2a" else x.s // x.cp
    att_f = machine.attention_seconds(causal_flops, keys, x.dtype, backward=False)
    att_b = machine.attention_seconds(2.5 * causal_flops, keys, x.dtype, backward=True)
    mem = _elementwise_bytes(x, moe_layer)
    tp_f, tp_b = _tp_comm(x, fwd_g, dgrad, tp_comm_overlap, mlp=not moe_layer or bool(x.f_s))
    cp_f, cp_b = _cp_comm(x, att_f, att_b)
    ep = _ep_comm(x) if moe_layer else 0.0
    fwd = _Pass(sum(fwd_g), att_f, machine.memory_seconds(mem, kernels=8), tp_f, cp_f, ep)
    bwd = _Pass(sum(dgrad) + sum(wgrad), att_b, machine.memory_seconds(2 * mem, kernels=12), tp_b, cp_b, ep)
    if m.recompute_granularity == "selective":
        bwd = bwd + _Pass(attention=att_f)
    return fwd, bwd


def _recomputed_layers(cfg, chunk_layers: int) -> int:
    m = cfg.model
    if m.recompute_granularity != "full":
        return 0
    return chunk_layers if m.recompute_method == "uniform" else min(m.recompute_num_layers, chunk_layers)


def _embedding_pass(x: _Shapes) -> tuple[_Pass, _Pass]:
    tokens = x.M / (x.tp if x.sp else 1)
    fwd = _Pass(memory=x.machine.memory_seconds(2 * x.e * tokens * x.h, kernels=2))
    if x.tp > 1:  # the vocab-parallel embedding's output reduced (reduce-scattered under SP)
        op = "reduce_scatter" if x.sp else "all_reduce"
        fwd = fwd + _Pass(tp=x.tp_collective(op, x.e * x.M * x.h))
    return fwd, fwd.scaled(2.0)


def _output_pass(x: _Shapes, tp_comm_overlap: bool) -> tuple[_Pass, _Pass]:
    vocab = x.cfg.model.padded_vocab_size // x.tp
    logits = x.M * vocab
    final_norm = 4 * x.e * x.M * x.h / (x.tp if x.sp else 1)
    fwd = _Pass(gemm=x.gemm(x.M, vocab, x.h),
                memory=x.machine.memory_seconds((x.e + 12) * logits + final_norm, kernels=6))
    bwd = _Pass(gemm=x.gemm(x.M, x.h, vocab) + x.gemm(x.h, vocab, x.M),
                memory=x.machine.memory_seconds((8 + x.e) * logits, kernels=4))
    if x.tp > 1:
        op = "all_gather" if x.sp else "all_reduce"
        comm = x.tp_collective(op, x.e * x.M * x.h)
        comm_b = x.tp_collective("reduce_scatter" if x.sp else "all_reduce", x.e * x.M * x.h)
        if tp_comm_overlap and x.sp:
            comm, comm_b = _overlapped(comm, fwd.gemm, x.tp), _overlapped(comm_b, bwd.gemm / 2, x.tp)
        fwd = fwd + _Pass(tp=comm + 3 * x.tp_collective("all_reduce", 4 * x.M))  # + the loss's max/sums
        bwd = bwd + _Pass(tp=comm_b)
    return fwd, bwd


def _layer_key(cfg, x: _Shapes, tp_comm_overlap: bool, moe_layer: bool) -> tuple:
    """What one layer's passes depend on (not PP, VPP or DP; an MoE layer's on its expert groups)."""
    key = (repr(vars(cfg.model)), x.dtype, x.tp, x.cp, x.b, x.sp, cfg.parallel.cp_comm_type, x.tp_group,
           x.cp_group, x.tp_group.world, tp_comm_overlap, moe_layer)
    if moe_layer:
        key += (repr(x.moe), x.ep, x.etp, x.ep_group, x.etp_group, x.ep_etp_group)
    return key


def _cached_layer_passes(cfg, machine, x, tp_comm_overlap, memo, moe_layer):
    key = _layer_key(cfg, x, tp_comm_overlap, moe_layer) if memo is not None else None
    if key is not None and key in memo:
        return memo[key]
    passes = layer_passes(cfg, machine, tp_comm_overlap, moe_layer)
    if key is not None:
        memo[key] = passes
    return passes


def _stage_layers(cfg) -> list[list[list[tuple[int, bool]]]]:
    """Per pipeline stage, per model chunk, its layers as (global index, recomputed in backward)."""
    split = PipelineSplit.from_config(cfg)
    out = []
    for rank, chunks in enumerate(split.counts()):
        stage = []
        for chunk, n in enumerate(chunks):
            start, end = split.layer_range(rank, chunk)
            recomputed = start + _recomputed_layers(cfg, n)  # block: the chunk's first n
            stage.append([(index, index < recomputed) for index in range(start, end)])
        out.append(stage)
    return out


def _layer_kinds(cfg, machine, x: _Shapes, tp_comm_overlap: bool, memo) -> dict[bool, tuple[_Pass, _Pass]]:
    """{is an MoE layer: (forward, backward) of one such layer}."""
    kinds = {False: _cached_layer_passes(cfg, machine, x, tp_comm_overlap, memo, False)}
    if x.moe is not None:
        kinds[True] = _cached_layer_passes(cfg, machine, x, tp_comm_overlap, memo, True)
    return kinds


def _parts(cfg, machine, tp_comm_overlap: bool, memo: dict | None) -> tuple:
    """What the stages' passes and FSDP2's timeline share: (shapes, each kind of layer's passes,
    the embedding's and the output layer's passes, the stages' layers, each layer's kind)."""
    x = _Shapes(cfg, machine)
    return (x, _layer_kinds(cfg, machine, x, tp_comm_overlap, memo), _embedding_pass(x),
            _output_pass(x, tp_comm_overlap), _stage_layers(cfg),
            [is_moe_layer(x.moe, i) for i in range(cfg.model.num_layers)])


def stage_passes(cfg, machine, tp_comm_overlap: bool = False,
                 memo: dict | None = None) -> list[tuple[_Pass, _Pass]]:
    """(forward, backward) of one micro-batch through each pipeline stage (all its chunks). memo: a
    dict kept by a caller that predicts many layouts of one model on one machine."""
    return _stage_passes(_parts(cfg, machine, tp_comm_overlap, memo))


def _stage_passes(parts: tuple) -> list[tuple[_Pass, _Pass]]:
    _, kinds, embed, output, layers, moe_layers = parts
    out = []
    for rank, chunks in enumerate(layers):
        fwd, bwd = _Pass(), _Pass()
        for index, recomputed in itertools.chain.from_iterable(chunks):
            layer_f, layer_b = kinds[moe_layers[index]]
            fwd, bwd = fwd + layer_f, bwd + layer_b + (layer_f if recomputed else _Pass())
        if rank == 0:
            fwd, bwd = fwd + embed[0], bwd + embed[1]
        if rank == len(layers) - 1:
            fwd, bwd = fwd + output[0], bwd + output[1]
        out.append((fwd, bwd))
    return out


def host_seconds(cfg, machine) -> tuple[list[float], float]:
    """(each stage's host overhead per micro-batch, the step's host overhead on its slowest rank):
    see the module docstring."""
    terms = machine.host_overhead(sharding_name(cfg))
    layers = _stage_layers(cfg)
    selective = terms["selective_layer_micro_batch_s"] \
        if cfg.model.recompute_granularity == "selective" else 0.0
    per_mb = []
    for chunks in layers:
        flat = list(itertools.chain.from_iterable(chunks))
        recomputed = sum(1 for _, again in flat if again)
        per_mb.append(terms["micro_batch_s"] * len(chunks)
                      + (terms["layer_micro_batch_s"] + selective) * len(flat)
                      + terms["recomputed_layer_micro_batch_s"] * recomputed)
    tensors = max(param_tensors(cfg, r) for r in range(len(layers))) if terms["param_tensor_s"] else 0
    return per_mb, machine.iteration_overhead_s + terms["step_s"] + terms["param_tensor_s"] * tensors


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
    FSDP2's are fsdp_stages'); an MoE stage's expert-DP reduction adds to its DP x CP one (both
    hide behind the same backward)."""
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


def fsdp_stages(cfg, machine, parts: tuple, shared: float) -> list[fsdp.StageFsdp]:
    """FSDP2's exposed time on each pipeline stage (megafab.plan.fsdp), each unit's collectives
    against its own layer's compute (parts: _parts'; shared: see predict)."""
    x, kinds, _, output, layers, moe_layers = parts
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
    """Adam over this rank's shard: fp32 main params, grads, m, v read and written, the 16-bit copy
    written, the gradient norm read; offloaded, PCIe both ways and the CPU's Adam."""
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


def _shared_pipeline(cfg, machine, parts: tuple, fsdp_per_mb: list[float], host_mb: list[float],
                     p2p: float):
    """The schedule on a CPU whose cores the ranks share (schedule.shared_pipeline_time): each
    stage's kernels and host work are compute, split between forward and backward as its kernels
    are; its collectives and FSDP2's exposed unit work are not."""
    p = cfg.parallel
    ranks_per_stage = min(p.world_size, machine.gpus_per_node) // p.pipeline_model_parallel_size
    forward, backward = [], []
    for (f, b), g, h in zip(_stage_passes(parts), fsdp_per_mb, host_mb):
        share_f = f.compute / (f.compute + b.compute) if f.compute + b.compute else 0.5
        forward.append(StagePass(f.compute + share_f * h, f.comm + share_f * g))
        backward.append(StagePass(b.compute + (1 - share_f) * h, b.comm + (1 - share_f) * g))
    return shared_pipeline_time(forward, backward, cfg.training.num_micro_batches or 1,
                                p.virtual_pipeline_model_parallel_size or 1, p2p,
                                lambda busy: machine.sharing(ranks_per_stage * busy))


def predict(cfg, machine, stages, tp_comm_overlap: bool = False, memo: dict | None = None) -> Prediction:
    """Step time of the finalized cfg whose memory plan is `stages` (megafab.plan.planner.plan);
    memo: see stage_passes."""
    p, t = cfg.parallel, cfg.training
    # ranks sharing a CPU's cores run their compute in turn (collectives are measured so already)
    shared = machine.sharing(min(p.world_size, machine.gpus_per_node))
    # megafab refuses Transformer Engine with FSDP2 (config rules), so an FSDP2 layout never has
    # TE's userbuffers TP overlap (what tp_comm_overlap assumes)
    overlap = tp_comm_overlap and not p.fully_sharded
    parts = _parts(cfg, machine, overlap, memo)
    passes = [(f.compute_scaled(shared), b.compute_scaled(shared)) for f, b in _stage_passes(parts)]
    sharded = fsdp_stages(cfg, machine, parts, shared) if p.fully_sharded else None
    per_mb = [s.per_micro_batch for s in sharded] if sharded else [0.0] * len(passes)
    m_count = t.num_micro_batches or 1
    vpp = p.virtual_pipeline_model_parallel_size or 1
    x = parts[0]
    boundary = x.e * x.M * x.h / (x.tp if x.sp else 1)
    host_alone, host_step = host_seconds(cfg, machine)
    host_mb = [shared * h for h in host_alone]
    seconds = [f.total + b.total + g + h for (f, b), g, h in zip(passes, per_mb, host_mb)]
    p2p = p2p_seconds(machine, boundary, group_placement(cfg, machine, "pp"))
    if machine.compute_slots and p.pipeline_model_parallel_size > 1:
        pipe = _shared_pipeline(cfg, machine, parts, per_mb, host_alone, p2p)
    else:
        pipe = pipeline_time(seconds, m_count, vpp, p2p)
    dp = data_parallel_seconds(cfg, machine, stages, passes)
    if sharded:
        # the reducing micro-batch's backward runs through the stages in turn; each stage's tail
        # hides behind the backward still to come on the stages before it (1F1B drain)
        dp = sum(s.reducing for s in sharded) + max(
            0.0, max(s.tail - i * b.total for i, (s, (_, b)) in enumerate(zip(sharded, passes))))
    opt = optimizer_seconds(cfg, machine, stages) * shared
    syncs = step_sync_seconds(cfg, machine)
    step = pipe.total + dp + syncs + opt + shared * host_step
    slowest = max(range(len(passes)), key=lambda i: seconds[i])
    f, b = passes[slowest]
    parts = (f + b).scaled(m_count)
    breakdown = {"gemm": parts.gemm, "attention": parts.attention, "memory_bound": parts.memory,
                 "tp_comm": parts.tp, "cp_comm": parts.cp, "ep_comm": parts.ep, "pp_bubble": pipe.bubble,
                 "pp_p2p": pipe.p2p,
                 "dp_comm": dp, "step_syncs": syncs, "fsdp_gather": m_count * per_mb[slowest],
                 "optimizer": opt,
                 "host_micro_batches": m_count * host_mb[slowest], "overhead": shared * host_step}
    flops = flops_per_iteration(cfg, t.global_batch_size)
    tflops = flops / p.world_size / step / 1e12
    peak = machine.peak(cfg.precision.params_dtype_name) / 1e12
    tokens = t.global_batch_size * cfg.model.seq_length / step
    return Prediction(step, tokens, tflops, tflops / peak if peak else 0.0, breakdown)
