"""One transformer layer's forward and backward on one rank for one micro-batch, in seconds, from
the shapes of a finalized Config on a Machine (and the embedding's and output layer's passes).

Notation as megafab.plan.planner: s sequence, b micro-batch, h hidden, a heads, g query groups,
d head width, f ffn width, V padded vocab, t TP, c CP, e bytes per element; M = b s / c tokens per
rank in every GEMM (under SP the GEMMs run on the TP-gathered sequence).

  GEMMs     forward QKV, projection, fc1, fc2 (_linear_shapes; an MoE layer's router and experts
            too); backward the data and the weight gradient of each (2x the forward).
  attention flash kernels doing the causal half of the 4 b s^2 (a/t) d / c forward FLOPs (the
            backward recomputes the scores: 2.5x), at the machine's attention efficiency.
  memory    norms, bias/dropout/residual adds, activation, RoPE: bytes over HBM (backward 2x).
  comm      TP/SP (_tp_comm), CP (_cp_comm), MoE token dispatch (_ep_comm): exposed seconds.
  recompute full: the layer's forward again; selective: each module's (_selective_recompute).
First stage: the embedding (memory-bound); last: final norm, output layer, fp32 cross entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

from megafab.config.moe import moe_settings
from megafab.model.activations import gated_linear_unit
from megafab.model.recompute import RecomputeSettings
from megafab.plan.collectives import collective_seconds, group_placement, p2p_seconds
from megafab.plan.moe import expected_rows, expert_sizes, router_tokens
from megafab.plan.state_memory import BYTES


@dataclass
class Pass:
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

    def __add__(self, other: Pass) -> Pass:
        return Pass(self.gemm + other.gemm, self.attention + other.attention, self.memory + other.memory,
                     self.tp + other.tp, self.cp + other.cp, self.ep + other.ep)

    def compute_scaled(self, k: float) -> Pass:
        return Pass(self.gemm * k, self.attention * k, self.memory * k, self.tp, self.cp, self.ep)

    def scaled(self, k: float) -> Pass:
        return Pass(self.gemm * k, self.attention * k, self.memory * k, self.tp * k, self.cp * k,
                     self.ep * k)


class Shapes:
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


def _mlp_shapes(x: Shapes, rows: int, f: int, parts: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of fc1 and fc2 of an MLP of width f split `parts` ways, on `rows` rows."""
    fc1 = f * (2 if gated_linear_unit(x.cfg.model) else 1)
    return [(rows, fc1 // parts, x.h), (rows, x.h, f // parts)]


def attention_shapes(x: Shapes) -> list[tuple[int, int, int]]:
    """(m, n, k) of attention's forward GEMMs on one TP rank: QKV and the projection, or multi-latent
    attention's (model/mla.py: every projection column-parallel) down and up projections and its
    projection [M, n v/t] x [n v/t, h]."""
    m = x.cfg.model
    if not m.multi_latent_attention:
        return [(x.M, (x.a + 2 * x.g) * x.d // x.tp, x.h), (x.M, x.h, x.a * x.d // x.tp)]
    qk, pe, v, ql, kl = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.q_lora_rank, m.kv_lora_rank
    q = [(x.M, x.a * (qk + pe) // x.tp, x.h)] if ql is None else \
        [(x.M, ql // x.tp, x.h), (x.M, x.a * (qk + pe) // x.tp, ql)]
    return q + [(x.M, (kl + pe) // x.tp, x.h), (x.M, x.a * (qk + v) // x.tp, kl), (x.M, x.h, x.a * v // x.tp)]


def _linear_shapes(x: Shapes, moe_layer: bool = False) -> list[tuple[int, int, int]]:
    """(m, n, k) of the layer's forward GEMMs on one TP rank: QKV [M, h] x [h, (a+2g)d/t], projection
    [M, ad/t] x [ad/t, h], then fc1 [M, h] x [h, f/t] (2f/t with SwiGLU) and fc2 [M, f/t] x [f/t, h]
    of the dense MLP; or of an MoE layer (megafab.plan.moe) its shared experts as a dense MLP (if
    any), the router [N, h] x [h, E] and each local expert's fc1/fc2 on its share of the balanced
    routed rows (N k t_e / E_l). Backward: the data gradient [M, n] x [n, k] and the weight gradient
    [k, M] x [M, n] of each."""
    attention = attention_shapes(x)
    if not moe_layer:
        return attention + _mlp_shapes(x, x.M, x.f, x.tp)
    shared = _mlp_shapes(x, x.M, x.f_s, x.tp) if x.f_s else []
    local = x.moe.num_experts // x.ep
    experts = _mlp_shapes(x, x.rows // local, x.f_e, x.etp) * local
    return attention + shared + [(x.N, x.moe.num_experts, x.h)] + experts


def _elementwise_bytes(x: Shapes, moe_layer: bool = False) -> float:
    """Forward bytes of the layer's memory-bound kernels on one rank; an MoE layer's activation runs
    on its routed rows and shared experts, plus the router's softmax/top-k over [N, E] in fp32 and
    the permutation of the N k routed copies in dispatch and combine (read and written)."""
    m = x.cfg.model
    tokens = x.M / (x.tp if x.sp else 1)  # the norm/dropout region is sequence-sharded under SP
    mask = 1 if m.hidden_dropout > 0 else 0
    norms = 2 * 2 * x.e * tokens * x.h
    residual_adds = 2 * (3 * x.e + mask) * tokens * x.h
    act = (3 if gated_linear_unit(m) else 2) * x.e
    if moe_layer:
        copies = x.N * x.moe.moe_router_topk
        activation = act * (x.rows * x.f_e / x.etp + x.M * x.f_s / x.tp) \
            + 4 * 4 * x.N * x.moe.num_experts + 2 * 2 * x.e * copies * x.h
    else:
        activation = act * x.M * x.f / x.tp
    return norms + residual_adds + activation + _rope_bytes(x)


def _rope_bytes(x: Shapes) -> float:
    """RoPE read and written on one rank: q and k's heads, d channels each; under multi-latent attention
    only the positional channels, of the rank's query heads and the one key head all heads share."""
    m = x.cfg.model
    if m.position_embedding_type not in ("rope", "yarn"):
        return 0
    if m.multi_latent_attention:
        return 2 * x.e * x.M * (x.a / x.tp + 1) * m.qk_pos_emb_head_dim
    return 2 * x.e * x.M * (x.a + x.g) * x.d / x.tp


def _overlapped(comm: float, gemm: float, chunks: int) -> float:
    """What stays exposed of a collective pipelined with a GEMM in `chunks` pieces."""
    return max(comm / chunks, comm - gemm * (chunks - 1) / chunks)


def _tp_comm(x: Shapes, gemms_fwd: list[float], gemms_dgrad: list[float],
             overlap: bool, mlp: bool = True) -> tuple[float, float]:
    """(forward, backward) exposed TP/SP collectives of one layer; mlp: the MLP's pair too (an MoE
    layer has it only for its shared experts: the routed tokens travel by the dispatcher). With SP:
    forward 2 all-gathers + 2 reduce-scatters of e M h bytes; backward 2 + 2 more, and the SP input
    re-gathered for the weight gradient (2 all-gathers, which the linear layer overlaps with the
    data-gradient GEMM); without SP: 2 + 2 all-reduces. overlap (Transformer Engine's userbuffers,
    Megatron's --tp-comm-overlap) pipelines each collective with its GEMM in t chunks: one chunk
    stays exposed, and what the GEMM cannot cover."""
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


def _ep_comm(x: Shapes) -> float:
    """One MoE layer's token dispatch and combine, forward (backward moves the same bytes back, not
    overlapped):
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


def _cp_comm(x: Shapes, attention_fwd: float, attention_bwd: float) -> tuple[float, float]:
    """(forward, backward) exposed CP communication of one layer. p2p: c-1 K/V ring steps, each
    hidden behind one attention block, backward sending dK/dV too; allgather: K/V gathered, their
    gradients reduce-scattered; a2a: q, k, v and the output re-sharded between sequence and heads."""
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


def layer_passes(cfg, machine, tp_comm_overlap: bool = False, moe_layer: bool = False) -> tuple[Pass, Pass]:
    """(forward, backward incl. recompute) of one transformer layer for one micro-batch on one rank;
    moe_layer: one with an MoE MLP."""
    x = Shapes(cfg, machine)
    m = cfg.model
    shapes = _linear_shapes(x, moe_layer)
    fwd_g = [x.gemm(*s) for s in shapes]
    dgrad = [x.gemm(mm, k, n) for mm, n, k in shapes]
    wgrad = [x.gemm(k, n, mm) for mm, n, k in shapes]
    heads = x.a // x.tp
    width = 2 * x.d  # scores over d channels, context over d (MLA: qk + pe, and v)
    if m.multi_latent_attention:
        width = m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim
    causal_flops = 2 * heads * width * x.M * x.s / 2  # M = b s / c queries, each meeting half the keys
    keys = x.s if cfg.parallel.cp_comm_type == "a2a" else x.s // x.cp
    att_f = machine.attention_seconds(causal_flops, keys, x.dtype, backward=False)
    att_b = machine.attention_seconds(2.5 * causal_flops, keys, x.dtype, backward=True)
    mem = _elementwise_bytes(x, moe_layer)
    tp_f, tp_b = _tp_comm(x, fwd_g, dgrad, tp_comm_overlap, mlp=not moe_layer or bool(x.f_s))
    cp_f, cp_b = _cp_comm(x, att_f, att_b)
    ep = _ep_comm(x) if moe_layer else 0.0
    fwd = Pass(sum(fwd_g), att_f, machine.memory_seconds(mem, kernels=8), tp_f, cp_f, ep)
    bwd = Pass(sum(dgrad) + sum(wgrad), att_b, machine.memory_seconds(2 * mem, kernels=12), tp_b, cp_b, ep)
    if m.recompute_granularity == "selective":
        bwd = bwd + _selective_recompute(x, moe_layer, fwd_g, att_f, ep)
    return fwd, bwd


def _selective_recompute(x: Shapes, moe_layer: bool, fwd_g: list[float], att_f: float, ep: float) -> Pass:
    """The forward work backward redoes under --recompute-modules: core_attn the attention kernel,
    layernorm the two norms, mlp a dense layer's fc1/fc2 and activation, moe an MoE layer's whole
    MLP (router, experts, shared experts, dispatch), shared_experts and moe_act their parts."""
    on = RecomputeSettings.from_model_config(x.cfg.model, check=False).selects
    tokens = x.M / (x.tp if x.sp else 1)
    act = (3 if gated_linear_unit(x.cfg.model) else 2) * x.e
    norms = x.machine.memory_seconds(2 * 2 * x.e * tokens * x.h, kernels=2)
    out = Pass(attention=att_f if on("core_attn") else 0.0, memory=norms if on("layernorm") else 0.0)
    if not moe_layer:
        if on("mlp"):
            activation = x.machine.memory_seconds(act * x.M * x.f / x.tp, kernels=1)
            out = out + Pass(gemm=sum(fwd_g[2:]), memory=activation)
        return out
    shared = 2 if x.f_s else 0
    routed = act * x.rows * x.f_e / x.etp
    if on("moe"):
        mlp_bytes = _elementwise_bytes(x, moe_layer) - _elementwise_bytes(x) + act * x.M * x.f / x.tp
        return out + Pass(gemm=sum(fwd_g[2:]), memory=x.machine.memory_seconds(mlp_bytes, kernels=4), ep=ep)
    if on("shared_experts") and shared:
        out = out + Pass(gemm=sum(fwd_g[2:2 + shared]),
                         memory=x.machine.memory_seconds(act * x.M * x.f_s / x.tp, kernels=1))
    if on("moe_act"):
        out = out + Pass(memory=x.machine.memory_seconds(routed, kernels=1))
    return out


def recomputed_layers(cfg, chunk_layers: int) -> int:
    m = cfg.model
    if m.recompute_granularity != "full":
        return 0
    return chunk_layers if m.recompute_method == "uniform" else min(m.recompute_num_layers, chunk_layers)


def embedding_pass(x: Shapes) -> tuple[Pass, Pass]:
    tokens = x.M / (x.tp if x.sp else 1)
    fwd = Pass(memory=x.machine.memory_seconds(2 * x.e * tokens * x.h, kernels=2))
    if x.tp > 1:  # the vocab-parallel embedding's output reduced (reduce-scattered under SP)
        op = "reduce_scatter" if x.sp else "all_reduce"
        fwd = fwd + Pass(tp=x.tp_collective(op, x.e * x.M * x.h))
    return fwd, fwd.scaled(2.0)


def output_pass(x: Shapes, tp_comm_overlap: bool) -> tuple[Pass, Pass]:
    vocab = x.cfg.model.padded_vocab_size // x.tp
    logits = x.M * vocab
    final_norm = 4 * x.e * x.M * x.h / (x.tp if x.sp else 1)
    fwd = Pass(gemm=x.gemm(x.M, vocab, x.h),
                memory=x.machine.memory_seconds((x.e + 12) * logits + final_norm, kernels=6))
    bwd = Pass(gemm=x.gemm(x.M, x.h, vocab) + x.gemm(x.h, vocab, x.M),
                memory=x.machine.memory_seconds((8 + x.e) * logits, kernels=4))
    if x.tp > 1:
        op = "all_gather" if x.sp else "all_reduce"
        comm = x.tp_collective(op, x.e * x.M * x.h)
        comm_b = x.tp_collective("reduce_scatter" if x.sp else "all_reduce", x.e * x.M * x.h)
        if tp_comm_overlap and x.sp:
            comm, comm_b = _overlapped(comm, fwd.gemm, x.tp), _overlapped(comm_b, bwd.gemm / 2, x.tp)
        fwd = fwd + Pass(tp=comm + 3 * x.tp_collective("all_reduce", 4 * x.M))  # + the loss's max/sums
        bwd = bwd + Pass(tp=comm_b)
    return fwd, bwd


def _layer_key(cfg, x: Shapes, tp_comm_overlap: bool, moe_layer: bool) -> tuple:
    """What one layer's passes depend on (not PP, VPP or DP; an MoE layer's on its expert groups)."""
    key = (repr(vars(cfg.model)), x.dtype, x.tp, x.cp, x.b, x.sp, cfg.parallel.cp_comm_type, x.tp_group,
           x.cp_group, x.tp_group.world, tp_comm_overlap, moe_layer)
    if moe_layer:
        key += (repr(x.moe), x.ep, x.etp, x.ep_group, x.etp_group, x.ep_etp_group)
    return key


def cached_layer_passes(cfg, machine, x, tp_comm_overlap, memo, moe_layer):
    key = _layer_key(cfg, x, tp_comm_overlap, moe_layer) if memo is not None else None
    if key is not None and key in memo:
        return memo[key]
    passes = layer_passes(cfg, machine, tp_comm_overlap, moe_layer)
    if key is not None:
        memo[key] = passes
    return passes

