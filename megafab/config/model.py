"""The model section of the configuration (`cfg.model`): the GPT architecture (layers, widths, attention,
positions, norms, activation, vocabulary), under Megatron's names and defaults. Fields are declared
with `option(...)` as megafab/config/schema.py describes; the MoE fields are config/moe.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from megafab.config.fields import Section, option
from megafab.config.moe import parse_layer_freq

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def parse_window_size(text) -> tuple[int, ...]:
    """--window-size as Megatron's tuple_type reads it: "128,0" or "(128,0)" -> (128, 0); a config
    file's list [128, 0] too."""
    try:
        return tuple(int(i) for i in str(text).strip().strip("()[]").split(","))
    except ValueError:
        raise ValueError(f"--window-size {text!r} is not a pair of ints like '(128,0)'") from None


def parse_window_attn_skip_freq(text) -> int | tuple[int, ...]:
    return parse_layer_freq(text, "--window-attn-skip-freq")


parse_window_size.__name__ = "tuple_type"  # Megatron's names for the types, shown by argparse
parse_window_attn_skip_freq.__name__ = "moe_freq_type"


@dataclass
class ModelConfig(Section):
    num_layers: int | None = option(
        None, help="Number of transformer layers in the whole model (all pipeline stages together).")
    hidden_size: int | None = option(None, help="Width of the residual stream, h.")
    ffn_hidden_size: int | None = option(
        None, help="MLP inner width; default 4h, or int((4h * 2/3) / 64) * 64 with --swiglu.")
    num_attention_heads: int | None = option(None, help="Number of query heads.")
    kv_channels: int | None = option(
        None, help="Width of one attention head; default hidden_size / num_attention_heads.")
    group_query_attention: bool = option(
        False, help="Share key/value heads among groups of query heads (GQA).")
    num_query_groups: int | None = option(
        None, help="Number of key/value heads with GQA; equals num_attention_heads without it.")
    seq_length: int | None = option(None, help="Tokens per sample.")
    max_position_embeddings: int | None = option(
        None, help="Size of the learned position table; default seq_length.")
    position_embedding_type: str = option(
        "learned_absolute", choices=("learned_absolute", "rope", "yarn", "none"),
        help="learned_absolute, rope, yarn (RoPE with YaRN's frequency scaling, for standard attention: "
             "Megatron-LM's spelling after core 0.16) or none.")
    rotary_base: int = option(10000, help="RoPE base (theta).")
    rotary_percent: float = option(1.0, help="Fraction of each head's channels that RoPE rotates.")
    rotary_interleaved: bool = option(
        False, help="RoPE rotates adjacent channel pairs (2i, 2i+1) by frequency i (GPT-J's order) instead "
                    "of channel i with i + d/2.")
    # ---- Llama-3 RoPE scaling and position interpolation (megatron-core's RotaryEmbedding) ----
    use_rope_scaling: bool = option(
        False, help="Llama 3.x RoPE scaling (HF's rope_type llama3) of plain RoPE's frequencies.")
    rope_scaling_factor: float = option(8.0, help="Llama 3.x RoPE scaling factor.")
    rope_scaling_low_freq_factor: float = option(
        1.0, help="Llama 3.x RoPE scaling's low_freq_factor (megatron-core fixes it at 1).")
    rope_scaling_high_freq_factor: float = option(
        4.0, help="Llama 3.x RoPE scaling's high_freq_factor (megatron-core fixes it at 4).")
    rope_scaling_original_max_position_embeddings: int = option(
        8192, help="Llama 3.x RoPE scaling's original context (megatron-core fixes it at 8192).")
    rotary_seq_len_interpolation_factor: float | None = option(
        None, help="Linear position interpolation: RoPE sees each position divided by this factor.")
    # ---- multi-latent attention (megatron-core's MLASelfAttention) and YaRN (model/rotary.py) ----
    multi_latent_attention: bool = option(
        False,
        help="Multi-latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents "
             "with a decoupled RoPE part shared by the heads (megatron-core's MLASelfAttention).")
    q_lora_rank: int | None = option(
        None,
        help="Rank of the query's low-rank latent (linear_q_down_proj / linear_q_up_proj); none: a direct "
             "query projection (linear_q_proj).")
    kv_lora_rank: int = option(32, help="Rank of the keys' and values' low-rank latent.")
    qk_head_dim: int = option(
        128,
        help="Width of a head's query/key part without RoPE; the query head is qk_head_dim + "
             "qk_pos_emb_head_dim wide.")
    qk_pos_emb_head_dim: int = option(
        64,
        help="Width of a head's RoPE part of queries and keys (one key part shared by all heads).")
    v_head_dim: int = option(128, help="Width of a head's value.")
    rope_type: str | None = option(
        None, choices=("rope", "yarn"),
        help="RoPE of multi-latent attention: rope or yarn (default yarn, as megatron-core's MLA config); "
             "standard attention takes rope only (YaRN there: --position-embedding-type yarn).")
    rotary_scaling_factor: float = option(
        1.0, help="YaRN's context-extension factor (scale); 1 leaves the frequencies as RoPE's.")
    mscale: float = option(1.0, help="YaRN's mscale (the attention factor on cos and sin).")
    mscale_all_dim: float = option(
        0.0,
        help="YaRN's mscale_all_dim (divides the attention factor; MLA squares it into the softmax scale).")
    yarn_original_max_position_embeddings: int | None = option(
        None,
        help="YaRN's original context length (HF's original_max_position_embeddings); default 4096.")
    yarn_beta_fast: float | None = option(
        None, help="YaRN's beta_fast (the correction range's high end); default 32.")
    yarn_beta_slow: float | None = option(
        None, help="YaRN's beta_slow (the correction range's low end); default 1.")
    yarn_correction_range_round_to_int: bool = option(
        True, action="store_true", negation="--no-yarn-correction-range-round-to-int",
        help="Round YaRN's correction range to whole channels.")
    normalization: str = option("LayerNorm", choices=("LayerNorm", "RMSNorm"), help="LayerNorm or RMSNorm.")
    norm_epsilon: float = option(1e-5, help="Epsilon of every norm.")
    swiglu: bool = option(False, help="SwiGLU MLP (gated SiLU) instead of GELU.")
    openai_gelu: bool = option(
        False, help="GELU in its tanh approximation (OpenAI GPT-2's gelu_new) instead of the exact erf GELU.")
    squared_relu: bool = option(False, help="relu(x)^2 as the MLP activation instead of GELU.")
    # ---- gpt-oss's clamped quick-GEGLU (model/activations.py) ----
    quick_geglu: bool = option(
        False,
        help="Gated MLP with quick_gelu(x) = x * sigmoid(1.702 x) on the gate (gpt-oss) instead of GELU.")
    activation_func_clamp_value: float | None = option(
        None,
        help="Clamp of a gated MLP's fc1 output before the activation: the gate to at most this value, the "
             "linear half to [-value, value] (gpt-oss: 7).")
    glu_linear_offset: float = option(
        0.0, help="Offset added to a gated MLP's linear half: act(gate) * (linear + offset) (gpt-oss: 1).")
    enable_gpt_oss: bool = option(
        False,
        help="gpt-oss's YaRN RoPE, as Megatron's ModelOpt model builder sets it: --position-embedding-type "
             "yarn with scaling factor 32, original context 131072, beta fast 32 / slow 1, mscale 1, "
             "mscale_all_dim 0, no rounding of the correction range (these replace the flags' values).")
    apply_layernorm_1p: bool = option(
        False,
        help="Zero-centered norm weight: every LayerNorm/RMSNorm computes norm(x) * (1 + weight) and its "
             "weight starts at 0 (megatron-core's layernorm_zero_centered_gamma).")
    qk_layernorm: bool = option(
        False,
        help="Normalize each head's queries and keys (q_layernorm / k_layernorm over kv_channels, the "
             "--normalization type) before RoPE and attention.")
    # ---- sliding-window attention and attention sinks (model/window_attention.py) ----
    window_size: tuple[int, ...] | None = option(
        None, parse=parse_window_size,
        help="Sliding-window attention (left, right): query i sees keys i-left..i (right must be 0: causal; "
             "left -1: unbounded). Megatron/TE's convention: HF's sliding_window W is (W-1, 0).")
    window_attn_skip_freq: int | tuple[int, ...] | None = option(
        None, parse=parse_window_attn_skip_freq,
        help="Which layers keep full attention with --window-size: N: every N-th layer (layers N, 2N, .. "
             "counted from 1), the others windowed; or a per-layer 0/1 pattern such as '([1]*3+[0]*1)*2' "
             "(1: window, 0: full). Unset: every layer windowed.")
    softmax_type: str = option(
        "vanilla", choices=SOFTMAX_TYPES,
        help="Attention sinks: vanilla softmax, off-by-one (an extra zero logit in the denominator) or "
             "learnable (a per-head logit, self_attention.core_attention.softmax_offset).")
    apply_residual_connection_post_layernorm: bool = option(
        False,
        help="Take the residual from the norm's output instead of its input (the original BERT order).")
    apply_query_key_layer_scaling: bool = option(
        False,
        help="Scale q k^T down by the layer number before 16-bit scores are formed and back up in the fp32 "
             "softmax (Megatron's fp16 overflow guard; the same values). SDPA's kernels form the scores "
             "in fp32 anyway; Transformer Engine gets NVTE_APPLY_QK_LAYER_SCALING=1.")
    attention_backend: str = option(
        "auto", choices=ATTENTION_BACKENDS,
        help="Attention kernel: auto (PyTorch SDPA picks), flash, fused (cuDNN / memory-efficient, CUDA "
             "only), unfused or local (SDPA's math kernel).")
    cross_entropy_loss_fusion: bool = option(
        False,
        help="Vocab-parallel cross entropy with the target logit and the sum of exponentials reduced over "
             "TP in one all-reduce instead of two (megatron-core's fused cross entropy); same values.")
    untie_embeddings_and_output_weights: bool = option(
        False, help="Give the output layer its own weight instead of reusing the word embedding.")
    add_bias_linear: bool = option(
        True, flags=("--disable-bias-linear",), action="store_false",
        help="Biases in the linear layers (--disable-bias-linear turns them off).")
    add_qkv_bias: bool = option(
        False, help="Bias in the QKV projection even when --disable-bias-linear is given.")
    hidden_dropout: float = option(0.1, help="Dropout on the residual branches.")
    attention_dropout: float = option(0.1, help="Dropout on attention probabilities.")
    init_method_std: float = option(
        0.02, help="Std of the normal init; output projections use std / sqrt(2 * num_layers).")
    make_vocab_size_divisible_by: int = option(
        128, help="Pad the vocabulary to a multiple of this times the tensor-parallel size.")
    vocab_size: int | None = option(
        None, help="Tokenizer vocabulary size (set from the tokenizer, or --vocab-size with NullTokenizer).")
    padded_vocab_size: int | None = option(
        None, help="Vocabulary size of the model (padded to be divisible by tensor model parallel size). If "
                   "not provided, it will be automatically calculated from vocab-size.")
    recompute_granularity: str | None = option(
        None, choices=("full", "selective"), group="activation recompute",
        help="Activation recompute: full (whole layers) or selective (the --recompute-modules).")
    recompute_method: str | None = option(
        None, choices=("uniform", "block"), group="activation recompute",
        help="With full recompute: uniform or block.")
    recompute_num_layers: int | None = option(
        None, group="activation recompute",
        help="Layers per recompute unit (uniform) or recomputed layers per stage (block).")
    recompute_modules: list[str] | None = option(
        None, nargs="*", group="activation recompute",
        help="With selective recompute, the submodules to recompute (default core_attn): core_attn, "
             "moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts. moe_act, layernorm and "
             "mla_up_proj discard their output and recompute it; the others are checkpointed.")
    transformer_impl: str = option(
        "local", choices=("local", "transformer_engine"),
        flag_help="default: local, or transformer_engine with --fp8-format (TE needs a GPU)",
        help="local (pure PyTorch) or transformer_engine (GPU only).")
    mtp_num_layers: int | None = option(
        None, group="multi-token prediction",
        help="Number of Multi-Token Prediction (MTP) layers: D sequential modules after the decoder (on the "
             "last pipeline stage) predict D additional tokens at each position, sharing the embedding and "
             "the output layer (megatron-core's MultiTokenPredictionBlock).")
    mtp_loss_scaling_factor: float = option(
        0.1, group="multi-token prediction",
        help="Scaling factor of the MTP loss: the mean of the MTP losses over the depths, times this "
             "factor, is added to the training objective (the logged lm loss stays the main loss).")
    compile_layers: bool = option(
        False, flags=("--compile",),
        flag_help="megafab only, not a Megatron flag: torch.compile each transformer layer",
        help="megafab's own --compile (not a Megatron flag): wrap each transformer layer in torch.compile.")
