"""Activation memory of the planner: what one layer, the embedding and the loss keep for backward per
micro-batch on one rank, a context-parallel layer's K/V exchange buffers, and how many micro-batches
of a pipeline stage are in flight at once. From the config's sizes alone: these are the published
formulas (Korthikanti et al. 2022) for megafab's kernels, measured against saved tensors in tests.

Notation: s sequence, b micro-batch, h hidden, a heads, g query groups, d head width, f ffn width,
V padded vocab, t TP size, e bytes per activation element (2 for bf16/fp16, 4 for fp32);
r = t with sequence parallel, else 1 (the norm/dropout region is split over TP only under SP).
The terms are written out in layer_activation_bytes' docstring; plan() adds them per stage.
"""

from __future__ import annotations

from megafab.model.activations import gated_linear_unit
from megafab.model.recompute import RecomputeSettings
from megafab.plan.mla_activations import mla_attention_bytes
from megafab.plan.state_memory import BYTES


def mask_bytes(kernels: str, e: int) -> int:
    """Dropout masks: CUDA keeps a 1-byte mask, PyTorch's CPU dropout a mask in the model dtype."""
    return e if kernels == "cpu" else 1


def norm_stats_bytes(m, s: int, b: int) -> int:
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


def recompute_settings(cfg) -> RecomputeSettings:
    """The --recompute-* settings of a config (selective: which modules)."""
    return RecomputeSettings.from_model_config(cfg.model, check=False)


def layer_activation_bytes(cfg, kernels: str = "flash", recompute_core_attention: bool | None = None) -> int:
    """kernels: flash (GPU SDPA flash), unfused (the paper's softmax/dropout kernels), cpu (PyTorch's
    CPU SDPA: flash without attention dropout, the math kernel with it).

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
    Selective recompute, by module (recompute_core_attention None: as the config's modules say):
    core_attn drops the core-attention term (it keeps q, k, v: the QKV output); layernorm the two
    norm outputs and statistics (their inputs stay); mlp the dense MLP's TP-region share (its input
    stays: mlp_activation_bytes is then 0); the MoE modules are moe_mlp_activation_bytes'. Full
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
    """
    m, p, t = cfg.model, cfg.parallel, cfg.training
    selective = recompute_settings(cfg)
    if recompute_core_attention is None:
        recompute_core_attention = selective.core_attention
    s, b, h = m.seq_length, t.micro_batch_size, m.hidden_size
    s //= p.context_parallel_size  # CP: each rank holds s/cp tokens of every activation
    a, g, d = m.num_attention_heads, m.num_query_groups, m.kv_channels
    tp = p.tensor_model_parallel_size
    r = tp if p.sequence_parallel else 1
    e = BYTES[cfg.precision.params_dtype_name]
    hidden_masks = 2 * mask_bytes(kernels, e) if m.hidden_dropout > 0 else 0
    replicated = s * b * h * (4 * e + hidden_masks) + 2 * norm_stats_bytes(m, s, b)
    if selective.selects("layernorm"):  # the norms' outputs freed, their statistics never kept
        replicated -= 2 * (e * s * b * h + norm_stats_bytes(m, s, b))
    qkv_saved = _qkv_output_saved(cfg, kernels, recompute_core_attention)
    qkv = (a + 2 * g) * d if qkv_saved else 0
    math_kernel = attention_kernels(cfg, kernels) == "cpu" and m.attention_dropout > 0 and \
        not recompute_core_attention
    rope = m.position_embedding_type in ("rope", "yarn")
    # The q and k given to attention are new tensors after RoPE (q also when copied out for GQA);
    # CPU's math kernel keeps its own copies instead.
    new_qk = 0 if math_kernel else (a * d if rope or g < a else 0) + (g * d if rope else 0)
    tp_region = e * s * b * (qkv + new_qk + a * d) / tp + mlp_activation_bytes(cfg)
    core = 0.0 if recompute_core_attention else core_attention_bytes(cfg, kernels)
    if m.multi_latent_attention:  # MLA's attention terms (plan/mla_activations.py) instead of QKV's
        return int(replicated / r + mlp_activation_bytes(cfg) + mla_attention_bytes(
            cfg, kernels, recompute_core_attention, selective.selects("mla_up_proj")))
    return int(replicated / r + tp_region + core)


def mlp_activation_bytes(cfg) -> int:
    """The dense MLP's share of the TP region of layer_activation_bytes: e*s*b*(f_1 + f (+ f))/t;
    0 with --recompute-modules mlp (the checkpoint keeps only the input, the norm's output)."""
    m, p = cfg.model, cfg.parallel
    if recompute_settings(cfg).selects("mlp"):
        return 0
    s, b = m.seq_length // p.context_parallel_size, cfg.training.micro_batch_size
    f, e = m.ffn_hidden_size, BYTES[cfg.precision.params_dtype_name]
    gated = gated_linear_unit(m)
    widths = f * (2 if gated else 1) + f + (f if gated else 0)
    return int(e * s * b * widths / p.tensor_model_parallel_size)


def kv_exchange_bytes(cfg) -> int:
    """Transient buffers of one layer's CP K/V exchange per rank (see layer_activation_bytes)."""
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
    """Chunk-micro-batches whose activations stage `pp_rank` holds at once: 1F1B stage i holds
    min(pp - i, M); interleaved min(2 (pp - i - 1) + (vpp - 1) pp + 1, M vpp) (Megatron's warmup + 1);
    without pipelining one."""
    if pp == 1:
        return 1
    if vpp == 1:
        return min(pp - pp_rank, micro_batches)
    return min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1, micro_batches * vpp)
