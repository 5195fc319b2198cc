"""Pre-launch plan: per pipeline stage parameters, bytes of weights/grads/optimizer state, activation
memory, and FLOPs per iteration, from the config alone (no process group, no tensors).

Notation: s sequence, b micro-batch, h hidden, a heads, g query groups, d head width, f ffn width,
V padded vocab, t TP size, e bytes per activation element (2 for bf16/fp16, 4 for fp32);
r = t with sequence parallel, else 1 (the norm/dropout region is split over TP only under SP).

Training state per rank: megafab.plan.state_memory (Megatron's distributed-optimizer table,
FSDP2's ZeRO-3 shards, optimizer CPU offload's device and host bytes). Without FSDP2 or offload:
    weights     e_param * P
    grads       4 * P                       fp32 main grads (DDP's grad buffer)
    optimizer   12 * P (bf16/fp16: fp32 master + Adam m + v), 8 * P (fp32 model: m + v);
                divided by dp with --use-distributed-optimizer

Activations of one layer for one micro-batch, without recompute (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", eq. 1-4; for e = 2, g = a, f = 4h, unfused
attention and dropout this is s*b*h*(34 + 5*a*s/h), and s*b*h/t*(34 + 5*a*s/h) with TP + SP):
    replicated region, / r    s*b*h * (4e + 2*mask)     two norm inputs, QKV and fc1 inputs (the
                              + norm statistics         linear core saves them sharded under SP),
                                                        two hidden-dropout masks (1 byte on CUDA,
                                                        e bytes on CPU); LayerNorm's fp32 mean and
                                                        rstd (RMSNorm: rstd) per token
    TP region, / t            e*s*b*((a + 2g)*d + a*d + f_1 + f (+ f with SwiGLU))
                                                        QKV output, projection input, fc1 output
                                                        (f_1 = f, or 2f with SwiGLU), fc2 input;
                              + e*s*b*(a + g)*d with RoPE, + e*s*b*a*d with GQA only: the rotated q
                                                        and k (the query heads copied out of the
                                                        packed QKV with GQA)
    core attention, / t       flash:   e*s*b*a*d + 4*a*s*b   its output and log-sum-exp
                              unfused: a*s*s*b * (e + (1 + e if attention dropout))
                                                        softmax, dropout mask and output
                              cpu:     PyTorch's CPU kernels: flash without attention dropout; with
                                       it the math kernel, which saves scaled q, k^T and v and the
                                       probabilities, mask and dropped probabilities, all in at
                                       least fp32 (and then not the packed QKV output, except for
                                       fp32 multi-head attention, whose v is a view of it)
Selective recompute drops the core-attention term (it keeps q, k, v: the QKV output). Full
recompute keeps e*s*b*h / r per recomputed group (its input) and, during backward, one group's
activations at a time.
Per chunk: RoPE's cos and sin, 2*e*s*b*rot (shared by the chunk's layers, full sequence).
Embedding (first stage): the dropout mask s*b*h*mask / r. Logits + loss (last stage): final norm
input e*s*b*h / r, output-layer input e*s*b*h / r (sharded under SP, as every linear's input),
fp32 softmax 4*s*b*V / t; during the loss's backward also the logits' fp32 gradient 4*s*b*V / t
(plus its cast for a bf16/fp16 model), before any recomputed group's activations exist.

Context parallelism (cp > 1): every activation above is per rank with s -> s/cp (each rank holds
s/cp tokens). Core attention under p2p/allgather is megafab's block kernels, which keep what flash
keeps (output and fp32 log-sum-exp of the s/cp queries, whatever `kernels` says); under a2a the
chosen kernel runs on a/cp heads of all s tokens.
The K/V exchange adds a transient per rank, one layer at a time (kv = 2*b*g/t*d*s/cp elements):
p2p kv*(2e + 8) (K/V being sent and received, dK/dV in fp32 travelling with them in backward),
allgather cp*kv*(2e + 8) (gathered and reordered K/V, their fp32 gradients), a2a
2*e*b*(a + 2g)/t*d*s/cp (one all-to-all's send and receive buffers for q, k, v).

Mixture of experts (megafab.plan.moe, which states each term): an MoE layer's MLP is its router,
routed experts and shared experts. Parameters: the routed experts' split over ETP x EP (their
weights, grads and optimizer state reduced and sharded over expert-DP = world / (ETP EP PP), the
rest over DP x CP); totals, and active ones (k routed experts), over the whole model. Activations:
the dense MLP's TP-region term is replaced by the MoE MLP's, with the routed rows at their bound
(the capacity, or every token of the EP x ETP group without a capacity factor); each stage's line
also gives the total under balanced routing. One layer's dispatcher buffers add to the peak.

In flight (micro-batches whose activations are alive at once): 1F1B stage i holds min(pp - i, M);
interleaved: min(2*(pp - i - 1) + (vpp - 1)*pp + 1, M*vpp) chunk-micro-batches (Megatron's warmup
+ 1); without pipelining one.
"""

from __future__ import annotations

from dataclasses import dataclass

from megafab.config.moe import moe_settings
from megafab.pipeline_split import PipelineSplit
from megafab.plan.flops import flops_per_iteration
from megafab.plan.moe import (
    bound_rows,
    dense_mlp_params,
    dispatcher_bytes,
    expected_rows,
    expert_data_parallel_size,
    expert_sizes,
    is_moe_layer,
    moe_mlp_activation_bytes,
    moe_mlp_params,
    stage_state_bytes,
)
from megafab.plan.state_memory import BYTES, fsdp_moments


@dataclass
class StagePlan:
    pp_rank: int
    params: int  # on each TP rank of this stage (all its chunks)
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes_per_micro_batch: int  # all layers of this stage, no pipelining
    layer_activation_bytes: int  # one layer, one micro-batch
    logits_bytes: int  # last stage only
    in_flight: float  # micro-batches of this stage's activations alive at the peak
    activation_peak_bytes: int
    forward_saved_bytes: int = 0  # what one micro-batch's forward leaves saved for its backward
    host_bytes: int = 0  # optimizer CPU offload: main params, Adam state and copy buffers on the host
    fsdp_held_bytes: int = 0  # FSDP2: the root's gathered weights and unsharded grads in backward
    fsdp_transient_bytes: int = 0  # FSDP2: the largest unsharded-gradient moment on top
    fsdp_moment: str = ""  # FSDP2: which moment fsdp_transient_bytes is
    gather_transient_bytes: int = 0  # distributed optimizer: all-gather inputs after the step
    kv_exchange_bytes: int = 0  # context parallel: transient K/V exchange buffers (in the peak)
    expert_params: int = 0  # MoE: the routed experts' part of params (reduced over expert-DP)
    dispatcher_bytes: int = 0  # MoE: one layer's transient token-dispatch buffers (in the peak)
    balanced_activation_peak_bytes: int = 0  # MoE: activation_peak_bytes under balanced routing
    routing: str = "bound"  # MoE: the routed rows in activation_peak_bytes (plan's routing)

    @property
    def state_bytes(self) -> int:
        """Weights, grads and optimizer state on the device, at rest."""
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes

    def _moments(self, activations: int) -> dict[str, int]:
        """What comes on top of the state (and FSDP2's held root) at each candidate peak."""
        moments = {"activations": activations, "gather": self.gather_transient_bytes}
        if self.fsdp_held_bytes or self.fsdp_transient_bytes:
            moments["fsdp"] = self.fsdp_transient_bytes
        return moments

    @property
    def total_bytes(self) -> int:
        """Device bytes at the peak (peak_phase says where). Building the model and loading a
        checkpoint stay below it: they hold one layer unsharded at a time, and no activations.
        FSDP2's largest unsharded-gradient moment and the activations are one max (see
        megafab.plan.state_memory)."""
        moments = self._moments(self.activation_peak_bytes)
        return self.state_bytes + self.fsdp_held_bytes + max(moments.values())

    @property
    def balanced_total_bytes(self) -> int:
        """total_bytes with an MoE stage's routed rows at balanced routing instead of their bound."""
        return self.state_bytes + self.fsdp_held_bytes + max(
            self._moments(self.balanced_activation_peak_bytes).values())

    @property
    def peak_phase(self) -> str:
        """Where total_bytes is reached."""
        moments = self._moments(self.activation_peak_bytes)
        top = max(moments, key=moments.get)
        if top == "gather":
            return "training step: state + the parameter all-gather after the optimizer step"
        if top == "fsdp":
            return f"training step: state + FSDP2's root (gathered, unsharded grad) + {self.fsdp_moment}"
        if self.fsdp_held_bytes:
            return "training step: state + FSDP2's root (gathered, unsharded grad) + activations (backward)"
        return "training step: state + activations (backward)"


def _norm_params(m) -> int:
    return 2 * m.hidden_size if m.normalization == "LayerNorm" else m.hidden_size


def _attention_params(m, tp: int) -> int:
    """A layer's norms and attention on one TP rank (everything but its MLP)."""
    h, d, a, g = m.hidden_size, m.kv_channels, m.num_attention_heads, m.num_query_groups
    qkv = (a + 2 * g) * d
    n = 2 * _norm_params(m) + h * qkv // tp + a * d * h // tp
    if m.qk_layernorm:  # q_layernorm + k_layernorm over one head's d channels, replicated over TP
        n += 2 * _norm_params(m) * d // h
    if m.add_bias_linear or m.add_qkv_bias:
        n += qkv // tp
    if m.add_bias_linear:
        n += h
    return n


def layer_params(m, tp: int) -> int:
    """Parameters of one dense transformer layer on one TP rank."""
    return _attention_params(m, tp) + dense_mlp_params(m, tp)


def layer_param_split(cfg, index: int, tp: int, etp: int = 1, ep: int = 1,
                      experts: int | None = None) -> tuple[int, int]:
    """(all, expert) parameters of global layer `index` on one rank; experts: see moe_mlp_params."""
    m, moe = cfg.model, moe_settings(cfg)
    if not is_moe_layer(moe, index):
        return layer_params(m, tp), 0
    mlp = moe_mlp_params(m, moe, tp, etp, ep, experts)
    return _attention_params(m, tp) + mlp.total, mlp.experts


def fsdp_layer_units(cfg, index: int, tp: int, etp: int = 1, ep: int = 1) -> list[tuple[int, int]]:
    """FSDP2's groups of global layer `index` on one rank (megafab.distributed.fsdp.layer_units and
    expert_units), each (parameters sharded over DP x CP, over expert-DP): the layer itself (its
    two norms), its attention block, its MLP (an MoE layer's router and shared experts) and an MoE
    layer's routed experts, a group of their own over expert-DP; together layer_param_split's."""
    m, moe = cfg.model, moe_settings(cfg)
    norms = 2 * _norm_params(m)
    units = [(norms, 0), (_attention_params(m, tp) - norms, 0)]
    if not is_moe_layer(moe, index):
        return units + [(dense_mlp_params(m, tp), 0)]
    mlp = moe_mlp_params(m, moe, tp, etp, ep)
    return units + [(mlp.total - mlp.experts, 0), (0, mlp.experts)]


def _ends_params(m, tp: int, pre_process: bool, post_process: bool) -> int:
    """A chunk's embedding (first) and final norm and output layer (last) on one TP rank."""
    n = 0
    word = m.padded_vocab_size * m.hidden_size // tp
    if pre_process:
        n += word + (m.max_position_embeddings * m.hidden_size
                     if m.position_embedding_type == "learned_absolute" else 0)
    if post_process:
        n += _norm_params(m)
        tied = not m.untie_embeddings_and_output_weights
        if not (tied and pre_process):
            n += word
    return n


def chunk_params(m, tp: int, layers: int, pre_process: bool, post_process: bool) -> int:
    """A chunk of `layers` dense layers on one TP rank."""
    return layers * layer_params(m, tp) + _ends_params(m, tp, pre_process, post_process)


class _LayerParams:
    """layer_param_split of the config's layers, computed once per kind of layer (dense, MoE):
    every layer of a kind has the same (the layout search plans thousands of candidates)."""

    def __init__(self, cfg):
        self.cfg, self.tp = cfg, cfg.parallel.tensor_model_parallel_size
        self.ep, self.etp = expert_sizes(cfg)
        moe = moe_settings(cfg)
        self.moe_layer = [is_moe_layer(moe, i) for i in range(cfg.model.num_layers)]
        self.split = PipelineSplit.from_config(cfg)
        self.kinds: dict[bool, tuple[int, int]] = {}
        self.chunks: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def layer(self, index: int) -> tuple[int, int]:
        kind = self.moe_layer[index]
        if kind not in self.kinds:
            self.kinds[kind] = layer_param_split(self.cfg, index, self.tp, self.etp, self.ep)
        return self.kinds[kind]

    def chunk(self, pp_rank: int, chunk: int) -> list[tuple[int, int]]:
        """(all, expert) parameters of each layer of one model chunk, in order."""
        if (pp_rank, chunk) not in self.chunks:
            layers = range(*self.split.layer_range(pp_rank, chunk))
            self.chunks[pp_rank, chunk] = [self.layer(i) for i in layers]
        return self.chunks[pp_rank, chunk]


def stage_param_split(cfg, pp_rank: int, layers: _LayerParams | None = None) -> tuple[int, int]:
    """(all, expert) parameters of pipeline stage `pp_rank` on one rank (all its chunks); layers:
    the config's _LayerParams, if made already."""
    layers = layers or _LayerParams(cfg)
    total, expert = _stage_ends_params(cfg, pp_rank, layers.split), 0
    for c in range(len(layers.split.counts()[pp_rank])):
        for n, x in layers.chunk(pp_rank, c):
            total, expert = total + n, expert + x
    return total, expert


def _stage_ends_params(cfg, pp_rank: int, split: PipelineSplit) -> int:
    """The stage's chunks' embedding (first chunk of stage 0), final norm and output layer (last
    chunk of the last stage) on one TP rank: FSDP2's root units."""
    p = cfg.parallel
    pp, tp = p.pipeline_model_parallel_size, p.tensor_model_parallel_size
    chunks = len(split.counts()[pp_rank])
    return sum(_ends_params(cfg.model, tp, pp_rank == 0 and c == 0, pp_rank == pp - 1 and c == chunks - 1)
               for c in range(chunks))


def stage_params(cfg, pp_rank: int) -> int:
    return stage_param_split(cfg, pp_rank)[0]


def model_params(cfg) -> tuple[int, int]:
    """(total, active) parameters of the whole model: active counts the k routed experts a token
    passes through of each MoE layer (equal for a dense model)."""
    m = cfg.model
    moe = moe_settings(cfg)
    ends = _ends_params(m, 1, True, True)
    total = ends + sum(layer_param_split(cfg, i, 1)[0] for i in range(m.num_layers))
    if moe is None:
        return total, total
    active = ends + sum(layer_param_split(cfg, i, 1, experts=moe.moe_router_topk)[0]
                        for i in range(m.num_layers))
    return total, active


def largest_fsdp_unit(cfg, pp_rank: int, layers: _LayerParams | None = None) -> tuple[int, int]:
    """FSDP2's largest group below the chunks' roots on the stage, (all, expert) parameters: a
    dense layer's attention block or MLP (megafab.distributed.fsdp.layer_units), or an MoE layer
    (its dense part and its routed experts, counted together); layers: see stage_param_split."""
    m = cfg.model
    tp = cfg.parallel.tensor_model_parallel_size
    layers = layers or _LayerParams(cfg)
    attention = _attention_params(m, tp) - 2 * _norm_params(m)
    units = [(0, 0)]
    for c in range(len(layers.split.counts()[pp_rank])):
        for layer in layers.chunk(pp_rank, c):
            units.append(layer if layer[1] else (max(attention, dense_mlp_params(m, tp)), 0))
    return max(units)


def fsdp_root_params(cfg, pp_rank: int) -> tuple[int, int]:
    """(parameters of the stage's FSDP2 roots: each chunk's embedding, final norm and output layer;
    its word embedding's parameters, whose gradient the end of backward makes)."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    root = _stage_ends_params(cfg, pp_rank, PipelineSplit.from_config(cfg))
    return root, m.padded_vocab_size * m.hidden_size // tp if pp_rank == 0 else 0


def _mask_bytes(kernels: str, e: int) -> int:
    """Dropout masks: CUDA keeps a 1-byte mask, PyTorch's CPU dropout a mask in the model dtype."""
    return e if kernels == "cpu" else 1


def _norm_stats_bytes(m, s: int, b: int) -> int:
    return 4 * s * b * (2 if m.normalization == "LayerNorm" else 1)


def attention_kernels(cfg, kernels: str) -> str:
    """The kernels attention runs: CP p2p/allgather always use megafab's block kernels, which keep
    what flash attention keeps (output and log-sum-exp, no probabilities)."""
    p = cfg.parallel
    return "flash" if p.context_parallel_size > 1 and p.cp_comm_type != "a2a" else kernels


def core_attention_bytes(cfg, kernels: str) -> float:
    """Bytes the attention kernel itself keeps, on one TP rank (the QKV output is counted apart)."""
    m, t = cfg.model, cfg.training
    s, b, a, d = m.seq_length, t.micro_batch_size, m.num_attention_heads, m.kv_channels
    tp = cfg.parallel.tensor_model_parallel_size
    e = BYTES[cfg.precision.params_dtype_name]
    cp = cfg.parallel.context_parallel_size
    kernels = attention_kernels(cfg, kernels)
    if cp > 1 and cfg.parallel.cp_comm_type != "a2a":
        s //= cp  # megafab's block kernels keep what flash keeps, for this rank's s/cp queries
    elif cp > 1:  # a2a: the kernel sees a/cp heads of all s tokens
        a //= cp
    probs = a * s * s * b
    dropout = m.attention_dropout > 0
    if kernels == "unfused":
        return probs * (e + ((1 + e) if dropout else 0)) / tp
    if kernels == "cpu" and dropout:
        c = max(e, 4)
        return (3 * s * b * a * d * c + 3 * probs * c) / tp
    return (e * s * b * a * d + 4 * a * s * b) / tp


def _qkv_output_saved(cfg, kernels: str, recompute_core_attention: bool) -> bool:
    """CPU's math kernel (attention dropout) keeps its own copies of q, k, v, not the packed QKV."""
    m = cfg.model
    if recompute_core_attention or attention_kernels(cfg, kernels) != "cpu" or m.attention_dropout == 0:
        return True
    e = BYTES[cfg.precision.params_dtype_name]
    return m.num_query_groups == m.num_attention_heads and e >= 4


def layer_activation_bytes(cfg, kernels: str = "flash", recompute_core_attention: bool = False) -> int:
    """kernels: flash (GPU SDPA flash), unfused (the paper's softmax/dropout kernels), cpu (PyTorch's
    CPU SDPA: flash without attention dropout, the math kernel with it); see the module docstring."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    s, b, h = m.seq_length, t.micro_batch_size, m.hidden_size
    s //= p.context_parallel_size  # CP: each rank holds s/cp tokens of every activation
    a, g, d, f = m.num_attention_heads, m.num_query_groups, m.kv_channels, m.ffn_hidden_size
    tp = p.tensor_model_parallel_size
    r = tp if p.sequence_parallel else 1
    e = BYTES[cfg.precision.params_dtype_name]
    hidden_masks = 2 * _mask_bytes(kernels, e) if m.hidden_dropout > 0 else 0
    replicated = s * b * h * (4 * e + hidden_masks) + 2 * _norm_stats_bytes(m, s, b)
    fc1 = f * (2 if m.swiglu else 1)
    qkv_saved = _qkv_output_saved(cfg, kernels, recompute_core_attention)
    qkv = (a + 2 * g) * d if qkv_saved else 0
    math_kernel = attention_kernels(cfg, kernels) == "cpu" and m.attention_dropout > 0 and \
        not recompute_core_attention
    rope = m.position_embedding_type == "rope"
    # The q and k given to attention are new tensors after RoPE (q also when copied out for GQA);
    # CPU's math kernel keeps its own copies instead.
    new_qk = 0 if math_kernel else (a * d if rope or g < a else 0) + (g * d if rope else 0)
    tp_region = e * s * b * (qkv + new_qk + a * d + fc1 + f + (f if m.swiglu else 0)) / tp
    core = 0.0 if recompute_core_attention else core_attention_bytes(cfg, kernels)
    return int(replicated / r + tp_region + core)


def mlp_activation_bytes(cfg) -> int:
    """The dense MLP's share of the TP region of layer_activation_bytes: e*s*b*(f_1 + f (+ f))/t."""
    m, p = cfg.model, cfg.parallel
    s, b = m.seq_length // p.context_parallel_size, cfg.training.micro_batch_size
    f, e = m.ffn_hidden_size, BYTES[cfg.precision.params_dtype_name]
    widths = f * (2 if m.swiglu else 1) + f + (f if m.swiglu else 0)
    return int(e * s * b * widths / p.tensor_model_parallel_size)


def kv_exchange_bytes(cfg) -> int:
    """Transient buffers of one layer's CP K/V exchange per rank (see the module docstring)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    if cp == 1:
        return 0
    e = BYTES[cfg.precision.params_dtype_name]
    s, b, d = m.seq_length // cp, t.micro_batch_size, m.kv_channels
    kv = 2 * b * m.num_query_groups // tp * d * s
    if p.cp_comm_type == "a2a":
        return 2 * e * b * (m.num_attention_heads + 2 * m.num_query_groups) // tp * d * s
    return kv * (2 * e + 8) * (cp if p.cp_comm_type == "allgather" else 1)


def in_flight_chunks(pp: int, vpp: int, pp_rank: int, micro_batches: int) -> int:
    if pp == 1:
        return 1
    if vpp == 1:
        return min(pp - pp_rank, micro_batches)
    return min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1, micro_batches * vpp)


ROUTING = ("bound", "balanced")


def plan(cfg, kernels: str = "flash", routing: str = "bound") -> list[StagePlan]:
    """One StagePlan per pipeline stage (every TP/DP rank of a stage holds the same amounts);
    kernels="cpu": PyTorch's CPU kernels and gloo's collectives (state_memory); routing: an MoE
    model's routed rows at their bound, or balanced (the expected count; dropless routing can
    exceed it), in the activations and the peak (balanced_activation_peak_bytes has the latter)."""
    m, p, t, pr = cfg.model, cfg.parallel, cfg.training, cfg.precision
    pp, vpp, tp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1, \
        p.tensor_model_parallel_size
    s, b, h = m.seq_length, t.micro_batch_size, m.hidden_size
    s //= p.context_parallel_size  # CP: each rank holds s/cp tokens
    kv_exchange = kv_exchange_bytes(cfg)
    r = tp if p.sequence_parallel else 1
    e = BYTES[pr.params_dtype_name]
    granularity = m.recompute_granularity
    layer = layer_activation_bytes(cfg, kernels, recompute_core_attention=granularity == "selective")
    layer_input = e * s * b * h // r
    moe = moe_settings(cfg)
    # an MoE layer: its MoE MLP in place of the dense one, (layer bytes, dispatcher bytes) at the
    # routed rows' bound (the plan) and under balanced routing (shown beside it)
    routed = {}
    if moe is not None:
        for kind, rows in (("bound", bound_rows(cfg, moe)), ("balanced", expected_rows(cfg, moe))):
            routed[kind] = (layer - mlp_activation_bytes(cfg) + moe_mlp_activation_bytes(cfg, moe, rows, e),
                            dispatcher_bytes(cfg, moe, rows, e))

    def chunk_activations(sizes: list[int]) -> tuple[int, int]:
        """(kept per in-flight chunk, transient during its backward) for a chunk whose layers keep
        `sizes` bytes each."""
        if granularity != "full" or not sizes:
            return sum(sizes), 0
        n, per_chunk, largest = m.recompute_num_layers, len(sizes), max(sizes)
        if m.recompute_method == "uniform":
            return -(-per_chunk // n) * layer_input, min(n, per_chunk) * largest
        block = min(n, per_chunk)
        return block * layer_input + sum(sizes[block:]), largest if block else 0

    params_of = _LayerParams(cfg)
    split, moe_layers = params_of.split, params_of.moe_layer
    counts = split.counts()
    out = []
    for rank in range(pp):
        # the stage's largest chunk bounds what each in-flight chunk keeps
        chunk_layers = [range(*split.layer_range(rank, c)) for c in range(len(counts[rank]))]
        has_moe = any(moe_layers[i] for layers in chunk_layers for i in layers)
        # (kept per in-flight chunk, backward transient, dispatch buffers) with MoE layers at each kind
        kept = {kind: max(chunk_activations([moe_layer if moe_layers[i] else layer for i in layers])
                          for layers in chunk_layers) + (dispatch if has_moe else 0,)
                for kind, (moe_layer, dispatch) in (routed or {"bound": (layer, 0)}).items()}
        chunk_kept, transient, stage_dispatch = kept[routing if routed else "bound"]
        params, expert_params = stage_param_split(cfg, rank, params_of)
        first, last = rank == 0, rank == pp - 1
        embed = s * b * h * _mask_bytes(kernels, e) // r if first and m.hidden_dropout > 0 else 0
        rotary = vpp * 2 * e * s * b * int(m.kv_channels * m.rotary_percent) \
            if m.position_embedding_type == "rope" else 0
        logits = int((2 * e * s * b * h + _norm_stats_bytes(m, s, b)) / r
                     + 4 * s * b * m.padded_vocab_size / tp) if last else 0
        # The loss's backward makes the logits' gradient, fp32 [s*b, V/t] (and a cast to the model dtype)
        loss_backward = int((4 + (e if e != 4 else 0)) * s * b * m.padded_vocab_size / tp) if last else 0
        chunks = in_flight_chunks(pp, vpp, rank, t.num_micro_batches or 1)
        # Backward starts at the loss (logits alive, their gradient made); a recomputed group's
        # activations come later, once the logits are freed.
        fixed = (embed + rotary) * min(chunks, pp if pp > 1 else 1) + kv_exchange
        peaks = {kind: int(chunks * kept_ + fixed + max(logits + loss_backward, transient_) + dispatch_)
                 for kind, (kept_, transient_, dispatch_) in kept.items()}
        peak = peaks[routing if routed else "bound"]
        unit, expert_unit = largest_fsdp_unit(cfg, rank, params_of)
        root, embedding = fsdp_root_params(cfg, rank)
        state = stage_state_bytes(cfg, params, expert_params, unit, expert_unit, root=root,
                                  embedding=embedding)
        moments = fsdp_moments(cfg, unit - expert_unit, embedding)  # the dense part's, as state_bytes
        moment = max(moments, key=moments.get)
        out.append(StagePlan(
            pp_rank=rank, params=params, weights_bytes=state.weights, grads_bytes=state.grads,
            optimizer_bytes=state.optimizer, host_bytes=state.host, fsdp_held_bytes=state.fsdp_held,
            fsdp_transient_bytes=state.fsdp_transient, fsdp_moment=moment if p.fully_sharded else "",
            gather_transient_bytes=state.gather_transient,
            activation_bytes_per_micro_batch=vpp * (chunk_kept + transient) + embed + rotary + logits,
            layer_activation_bytes=max(layer, routed[routing][0]) if has_moe else layer, logits_bytes=logits,
            in_flight=chunks / vpp, activation_peak_bytes=peak, kv_exchange_bytes=kv_exchange,
            forward_saved_bytes=int(vpp * chunk_kept + embed + rotary + logits),
            expert_params=expert_params, dispatcher_bytes=stage_dispatch,
            balanced_activation_peak_bytes=peaks.get("balanced", peak), routing=routing))
    return out


def _sharding_summary(cfg) -> str:
    p, o = cfg.parallel, cfg.optimizer
    if p.fully_sharded:
        zero = "FSDP2 (ZeRO-3)" if p.fsdp_reshard_after_forward else "FSDP2 without resharding after forward"
    else:
        zero = f"distributed optimizer {'on' if p.use_distributed_optimizer else 'off'}"
    if o.optimizer_cpu_offload:
        zero += f", optimizer CPU offload {o.optimizer_offload_fraction:g}"
    return zero


def _routing_note(st: StagePlan) -> str:
    if not st.dispatcher_bytes:
        return ""
    if st.routing == "balanced":
        return " (routed rows balanced: dropless routing can exceed them)"
    balanced = st.balanced_total_bytes / 2.0**30
    return f" (routed rows at their bound; balanced routing: total {balanced:.2f} GiB)"


def parameters_line(cfg) -> str:
    """The whole model's parameter count; for MoE total and active (per token) and the expert grid."""
    total, active = model_params(cfg)
    moe = moe_settings(cfg)

    def count(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    if moe is None:
        return f"  parameters: {count(total)}"
    ep, etp = expert_sizes(cfg)
    return (f"  parameters: {count(total)} total, {count(active)} active ({moe.moe_router_topk} of "
            f"{moe.num_experts} routed experts per MoE layer); experts on EP {ep} x ETP {etp} x expert-DP "
            f"{expert_data_parallel_size(cfg)}, {moe.moe_token_dispatcher_type} dispatcher")


def iteration_flops(cfg) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs incl. full recompute's extra forward) per iteration, all ranks."""
    model = flops_per_iteration(cfg, cfg.training.global_batch_size)
    m = cfg.model
    if m.recompute_granularity == "full":
        return model, model * 4.0 / 3.0
    return model, model


def format_plan(cfg, stages: list[StagePlan], mfu: float = 0.4, peak_tflops: float = 989.0,
                gpu_memory_gb: float | None = None, step_time: str | None = None) -> str:
    """The plan as printed; `step_time`: the step-time model's line(s) (megafab.plan.report), which
    replace the fixed-MFU estimate."""
    gib = 2.0**30
    p = cfg.parallel
    vpp = f" (VPP {p.virtual_pipeline_model_parallel_size})" if p.virtual_pipeline_model_parallel_size else ""
    lines = [f"megafab plan: world {p.world_size} = TP {p.tensor_model_parallel_size} x PP "
             f"{p.pipeline_model_parallel_size} x DP {p.data_parallel_size}{vpp}"
             + (f" x CP {p.context_parallel_size} ({p.cp_comm_type})" if p.context_parallel_size > 1 else "")
             + f", {cfg.precision.params_dtype_name}, recompute {cfg.model.recompute_granularity or 'none'}, "
             f"{_sharding_summary(cfg)}", parameters_line(cfg)]
    for st in stages:
        fits = ""
        if gpu_memory_gb:
            fits = "  fits" if st.total_bytes / gib <= gpu_memory_gb else \
                f"  DOES NOT FIT {gpu_memory_gb} GiB"
        lines.append(
            f"  stage {st.pp_rank}: params {st.params / 1e6:.1f}M"
            + (f" (routed experts {st.expert_params / 1e6:.1f}M)" if st.expert_params else "")
            + f" | weights {st.weights_bytes / gib:.2f} GiB"
            f" | grads {st.grads_bytes / gib:.2f} GiB | optimizer {st.optimizer_bytes / gib:.2f} GiB"
            + (f" (+ host {st.host_bytes / gib:.2f} GiB)" if st.host_bytes else "")
            + (f" | FSDP2 root gathered/unsharded {st.fsdp_held_bytes / gib:.2f} GiB,"
               f" unit/embedding grads {st.fsdp_transient_bytes / gib:.2f} GiB"
               if st.fsdp_held_bytes or st.fsdp_transient_bytes else "") +
            f" | activations {st.activation_bytes_per_micro_batch / gib:.2f} GiB/micro-batch"
            f" (layer {st.layer_activation_bytes / 2**20:.1f} MiB, logits {st.logits_bytes / gib:.2f} GiB)"
            f" x {st.in_flight:g} in flight"
            + (f" + K/V exchange {st.kv_exchange_bytes / 2**20:.1f} MiB" if st.kv_exchange_bytes else "")
            + (f" + token dispatch {st.dispatcher_bytes / 2**20:.1f} MiB" if st.dispatcher_bytes else "")
            + f" = {st.activation_peak_bytes / gib:.2f} GiB"
            + (f" | all-gather inputs {st.gather_transient_bytes / gib:.2f} GiB"
               if st.gather_transient_bytes else "")
            + f" | total {st.total_bytes / gib:.2f} GiB at the {st.peak_phase}"
            + _routing_note(st) + fits)
    model, hardware = iteration_flops(cfg)
    if step_time is not None:
        lines.append(f"  FLOPs/iteration: model {model:.3e}, with recompute {hardware:.3e}")
        lines.append(step_time)
        return "\n".join(lines)
    seconds = hardware / (p.world_size * peak_tflops * 1e12 * mfu)
    lines.append(f"  FLOPs/iteration: model {model:.3e}, with recompute {hardware:.3e}; at MFU {mfu:g} of "
                 f"{peak_tflops:g} TFLOP/s/GPU: {seconds:.3f} s/iteration")
    return "\n".join(lines)
