"""The configuration's schema: one dataclass per concern, Megatron's names and defaults.

Field names equal the `dest` of Megatron's argparse flags (``--num-layers`` -> ``num_layers``), so a
Megatron user finds every knob under the name they know. Each field is declared once, with
`option(...)`: its default, its help text and, where they differ from what the field implies, its
flag spellings, choices, nargs, action, negation flag and argparse group. megafab/arguments.py
builds the command line from these declarations and nothing else. Adding a flag is one field:

    window_size: int | None = option(None, help="Sliding attention window.")

gives `--window-size N` (type int from the annotation, default None, the help in --help). A bool
field with default False is a store_true flag; `flags=("--no-x",), action="store_false"` spells a
field whose flag turns it off; `negation="--no-x"` adds a second, turning-off flag for a store_true
field. Fields made by `derived(...)` have no flag: config/derive.py computes them in finalize.

After `Config.finalize` every section is frozen: assigning a field raises FrozenInstanceError.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megafab.config.fields import Section, derived, option
from megafab.config.moe import MoEConfig

CKPT_FORMATS = ("torch_dist", "torch")  # Megatron's distributed and legacy checkpoint formats
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer")
MEGATRON_FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


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
        "learned_absolute", choices=("learned_absolute", "rope", "none"),
        help="learned_absolute, rope or none.")
    rotary_base: int = option(10000, help="RoPE base (theta).")
    rotary_percent: float = option(1.0, help="Fraction of each head's channels that RoPE rotates.")
    normalization: str = option("LayerNorm", choices=("LayerNorm", "RMSNorm"), help="LayerNorm or RMSNorm.")
    norm_epsilon: float = option(1e-5, help="Epsilon of every norm.")
    swiglu: bool = option(False, help="SwiGLU MLP (gated SiLU) instead of GELU.")
    openai_gelu: bool = option(
        False, help="GELU in its tanh approximation (OpenAI GPT-2's gelu_new) instead of the exact erf GELU.")
    squared_relu: bool = option(False, help="relu(x)^2 as the MLP activation instead of GELU.")
    apply_layernorm_1p: bool = option(
        False,
        help="Zero-centered norm weight: every LayerNorm/RMSNorm computes norm(x) * (1 + weight) and its "
             "weight starts at 0 (megatron-core's layernorm_zero_centered_gamma).")
    qk_layernorm: bool = option(
        False,
        help="Normalize each head's queries and keys (q_layernorm / k_layernorm over kv_channels, the "
             "--normalization type) before RoPE and attention.")
    apply_residual_connection_post_layernorm: bool = option(
        False,
        help="Take the residual from the norm's output instead of its input (the original BERT order).")
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
    padded_vocab_size: int | None = derived(
        None, help="Derived: vocab_size padded to a multiple of make_vocab_size_divisible_by * tp.")
    recompute_granularity: str | None = option(
        None, choices=("full", "selective"), group="activation recompute",
        help="Activation recompute: full or selective (core attention).")
    recompute_method: str | None = option(
        None, choices=("uniform", "block"), group="activation recompute",
        help="With full recompute: uniform or block.")
    recompute_num_layers: int | None = option(
        None, group="activation recompute",
        help="Layers per recompute unit (uniform) or recomputed layers per stage (block).")
    recompute_modules: list[str] | None = option(
        None, nargs="*", group="activation recompute",
        help="With selective recompute: which modules (core_attn is supported).")
    transformer_impl: str = option(
        "local", choices=("local", "transformer_engine"),
        flag_help="default: local, or transformer_engine with --fp8-format (TE needs a GPU)",
        help="local (pure PyTorch) or transformer_engine (GPU only).")
    compile_layers: bool = option(
        False, flags=("--compile",),
        flag_help="megafab only, not a Megatron flag: torch.compile each transformer layer",
        help="megafab's own --compile (not a Megatron flag): wrap each transformer layer in torch.compile.")


@dataclass
class ParallelConfig(Section):
    tensor_model_parallel_size: int = option(1, help="TP degree: ranks that split each layer's weights.")
    pipeline_model_parallel_size: int = option(1, help="PP degree: stages the layers are split over.")
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, help="Layers per model chunk for the interleaved schedule.")
    num_virtual_stages_per_pipeline_rank: int | None = option(
        None, help="Model chunks per pipeline rank for the interleaved schedule (alternative to the above).")
    decoder_first_pipeline_num_layers: int | None = option(
        None, help="Transformer layers on the first pipeline stage; the other stages share the rest evenly.")
    decoder_last_pipeline_num_layers: int | None = option(
        None, help="Transformer layers on the last pipeline stage; the other stages share the rest evenly.")
    account_for_embedding_in_pipeline_split: bool = option(
        False,
        help="Count the embedding as one layer when splitting layers over stages: the first stage (its "
             "first virtual chunk) holds one transformer layer fewer.")
    account_for_loss_in_pipeline_split: bool = option(
        False,
        help="Count the output layer + loss as one layer when splitting: the last stage (its last virtual "
             "chunk) holds one transformer layer fewer.")
    virtual_pipeline_model_parallel_size: int | None = derived(
        None, help="Derived: model chunks per pipeline rank (vpp); None without interleaving.")
    sequence_parallel: bool = option(
        False, help="Shard activations along the sequence in the non-TP regions (needs TP > 1).")
    context_parallel_size: int = option(
        1,
        help="CP degree: ranks that split every sequence; rank r holds chunks r and 2*cp-1-r of 2*cp "
             "(Megatron's causal load balancing) and attention is exact across them.")
    cp_comm_type: str = option(
        "p2p", nargs="+",
        flag_help="p2p, allgather (or all_gather) or a2a; one value for every layer",
        help="How CP attention exchanges keys/values: p2p (ring, partial results merged by log-sum-exp), "
             "allgather (all K/V gathered), a2a (DeepSpeed-Ulysses: heads scattered, sequence gathered).")
    expert_model_parallel_size: int = option(
        1,
        help="EP degree: ranks that split each MoE layer's routed experts (each holds num_experts / EP), "
             "folded over the same ranks as TP x CP x DP x PP.")
    expert_tensor_parallel_size: int | None = option(
        None,
        help="ETP degree: ranks that split each routed expert's weights; default "
             "--tensor-model-parallel-size (resolved at start-up).")
    data_parallel_size: int | None = derived(None, help="Derived: world_size / (tp * cp * pp).")
    world_size: int | None = derived(None, help="Derived: number of processes.")
    use_distributed_optimizer: bool = option(
        False, help="Shard fp32 main params and optimizer state across data-parallel ranks.")
    overlap_grad_reduce: bool = option(False, help="Start each gradient bucket's reduction during backward.")
    overlap_param_gather: bool = option(
        False, help="Overlap the distributed optimizer's parameter all-gather with the next forward.")
    ddp_bucket_size: int | None = option(
        None, help="Elements per gradient bucket; default max(40M, 1M * dp).")
    ddp_average_in_collective: bool = option(
        False, help="Average the gradients inside the data-parallel collective (NCCL's ReduceOp.AVG) "
                    "instead of scaling them by 1/DP before a sum; on gloo, which has no AVG, the "
                    "sum after scaling is kept (the same values).")
    gradient_accumulation_fusion: bool = option(
        True, action="store_true", negation="--no-gradient-accumulation-fusion",
        help="Add the linear layers' weight gradients straight into the fp32 main-grad buffer (Megatron's "
             "default); --no-gradient-accumulation-fusion goes through param.grad and a hook instead.")
    accumulate_allreduce_grads_in_fp32: bool = option(
        True, action="store_true",
        help="Keep main gradients in fp32 for bf16/fp16 models (turned off by --grad-reduce-in-bf16).")
    grad_reduce_in_bf16: bool = option(
        False,
        help="Accumulate and reduce gradients over data parallel in bf16 (the DDP grad buffer's dtype); "
             "the optimizer still steps fp32 main params.")
    distributed_backend: str | None = option(
        None, choices=("nccl", "gloo"), help="nccl or gloo; default nccl with CUDA, gloo without.")
    distributed_timeout_minutes: float = option(
        10,
        help="Timeout of every collective; a frozen rank fails the others after this long (fractions of a "
             "minute are accepted).")
    use_torch_fsdp2: bool = option(
        False, group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="ZeRO-3 with torch FSDP2: parameters, gradients and optimizer state sharded over "
             "data-parallel ranks, one FSDP unit per transformer layer plus the embedding/output (weight "
             "gradients go through autograd: there is no main_grad buffer for gradient accumulation "
             "fusion).")
    use_megatron_fsdp: bool = option(
        False,
        flags=("--use-megatron-fsdp", "--use-custom-fsdp"),
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="Megatron-FSDP's flag: megafab runs the --data-parallel-sharding-strategy it asks for with "
             "its own engines (DDP, the distributed optimizer, FSDP2), announced at start-up.")
    data_parallel_sharding_strategy: str | None = option(
        None,
        choices=MEGATRON_FSDP_STRATEGIES,
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="With --use-megatron-fsdp: no_shard (ZeRO-0, replicated), optim (ZeRO-1, the distributed "
             "optimizer), optim_grads (ZeRO-2: FSDP2 keeping gathered weights to the backward), "
             "optim_grads_params (ZeRO-3: FSDP2, Megatron's default).")
    torch_fsdp2_reshard_after_forward: bool = option(
        True,
        flags=("--torch-fsdp2-no-reshard-after-forward",),
        action="store_false",
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="FSDP2 frees each unit's gathered weights after its forward and gathers them again for the "
             "backward; --torch-fsdp2-no-reshard-after-forward keeps them (more memory, one all-gather "
             "less).")
    fully_sharded: bool = derived(
        False,
        help="Derived: FSDP2 runs (--use-torch-fsdp2, or --use-megatron-fsdp with optim_grads(_params)).")

    @property
    def fsdp_reshard_after_forward(self) -> bool:
        """Whether FSDP2 frees gathered weights after forward (ZeRO-3; not Megatron-FSDP's optim_grads)."""
        if self.use_megatron_fsdp and not self.use_torch_fsdp2:
            return self.data_parallel_sharding_strategy != "optim_grads"
        return self.torch_fsdp2_reshard_after_forward


@dataclass
class PrecisionConfig(Section):
    fp16: bool = option(False, help="Train in fp16 with a loss scaler.")
    bf16: bool = option(False, help="Train in bf16.")
    loss_scale: float | None = option(None, help="Static loss scale for fp16; dynamic scaling when unset.")
    initial_loss_scale: float = option(2.0**32, help="Starting dynamic loss scale.")
    min_loss_scale: float = option(1.0, help="Floor of the dynamic loss scale.")
    loss_scale_window: int = option(1000, help="Clean steps before the dynamic scale doubles.")
    hysteresis: int = option(2, help="Overflows tolerated before the dynamic scale halves.")
    fp8_format: str | None = option(
        None, choices=("e4m3", "hybrid"), help="FP8 with Transformer Engine: e4m3 or hybrid.")
    fp8_recipe: str = option(
        "delayed", choices=("delayed", "tensorwise", "mxfp8", "blockwise"),
        help="TE recipe: delayed, tensorwise, mxfp8 or blockwise.")
    fp8_margin: int = option(0, help="Margin of the FP8 scaling factor.")
    fp8_amax_history_len: int = option(1, help="Length of the amax history window.")
    fp8_amax_compute_algo: str = option(
        "most_recent", choices=("most_recent", "max"), help="most_recent or max over the history.")

    @property
    def params_dtype_name(self) -> str:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


@dataclass
class OptimizerConfig(Section):
    optimizer: str = option(
        "adam", choices=("adam", "sgd"), help="adam (AdamW, decoupled weight decay) or sgd.")
    lr: float | None = option(None, help="Peak learning rate.")
    min_lr: float = option(0.0, help="Learning rate at the end of decay.")
    lr_decay_style: str = option(
        "linear", choices=DECAY_STYLES,
        help="constant, linear, cosine, inverse-square-root or WSD.")
    lr_decay_iters: int | None = option(None, help="Iterations to decay over; default train_iters.")
    lr_decay_samples: int | None = option(None, help="Samples to decay over; default train_samples.")
    lr_warmup_fraction: float | None = option(None, help="Warmup as a fraction of the decay span.")
    lr_warmup_iters: int = option(0, help="Warmup iterations.")
    lr_warmup_samples: int = option(0, help="Warmup samples.")
    lr_warmup_init: float = option(0.0, help="Learning rate at the start of warmup.")
    override_opt_param_scheduler: bool = option(
        False, flags=("--override-opt_param-scheduler", "--override-opt-param-scheduler"),
        help="On resume, run the learning-rate and weight-decay schedule the command line gives, not the "
             "checkpoint's (by default a difference between them stops the run, as in Megatron).")
    use_checkpoint_opt_param_scheduler: bool = option(
        False, flags=("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"),
        help="On resume, keep the checkpoint's learning-rate and weight-decay schedule where the command "
             "line gives a different one.")
    lr_wsd_decay_style: str = option(
        "exponential", choices=WSD_DECAY_STYLES,
        help="Decay shape of the WSD schedule's final phase.")
    lr_wsd_decay_samples: int | None = option(None, help="Samples of WSD's final decay phase.")
    lr_wsd_decay_iters: int | None = option(None, help="Iterations of WSD's final decay phase.")
    weight_decay: float = option(0.01, help="Decoupled weight decay (not applied to biases and norms).")
    clip_grad: float = option(1.0, help="Clip gradients to this global L2 norm (0 disables).")
    adam_beta1: float = option(0.9, help="Adam beta1.")
    adam_beta2: float = option(0.999, help="Adam beta2.")
    adam_eps: float = option(1e-8, help="Adam epsilon.")
    sgd_momentum: float = option(0.9, help="SGD momentum.")
    decoupled_lr: float | None = option(
        None, help="Peak learning rate of the input embedding and the output layer (their own schedule).")
    decoupled_min_lr: float | None = option(
        None, help="Final learning rate of the input embedding and the output layer; default --min-lr.")
    optimizer_cpu_offload: bool = option(
        False, group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="Keep fp32 main params and Adam state in host memory and step them on the CPU (torch's "
             "fused/foreach AdamW); the device keeps the model weights and gradients.")
    optimizer_offload_fraction: float | None = option(
        None, group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="Share of the optimizer state offloaded, in [0, 1]; default 1.0 with --optimizer-cpu-offload.")
    pin_cpu_grads: bool = option(
        True,
        flags=("--no-pin-cpu-grads",),
        action="store_false",
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="Page-locked host gradient buffers for offload.")
    pin_cpu_params: bool = option(
        True,
        flags=("--no-pin-cpu-params",),
        action="store_false",
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="Page-locked host main params for offload.")
    use_precision_aware_optimizer: bool = option(
        False, group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="Megatron's flag that its CPU offload requires; megafab accepts it with "
             "--optimizer-cpu-offload (fp32 main params and Adam moments, its default dtypes, are what "
             "megafab keeps).")


@dataclass
class DataConfig(Section):
    data_path: list[str] | None = option(
        None, nargs="*",
        help="Prefixes (optionally weighted: w1 p1 w2 p2) of .bin/.idx datasets split by --split.")
    split: str | None = option(None, help="Train/valid/test proportions over documents, e.g. 969,30,1.")
    train_data_path: list[str] | None = option(None, nargs="*", help="Separate training prefixes.")
    valid_data_path: list[str] | None = option(None, nargs="*", help="Separate validation prefixes.")
    test_data_path: list[str] | None = option(None, nargs="*", help="Separate test prefixes.")
    data_cache_path: str | None = option(None, help="Where the sample-index .npy caches live.")
    mock_data: bool = option(False, help="Random tokens, no files: for smoke tests and benchmarks.")
    tokenizer_type: str | None = option(
        None,
        choices=TOKENIZER_TYPES,
        help="GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, "
             "HuggingFaceTokenizer or NullTokenizer.")
    vocab_file: str | None = option(None, help="GPT-2 vocab.json.")
    merge_file: str | None = option(None, help="GPT-2 merges.txt.")
    tokenizer_model: str | None = option(
        None, help="SentencePiece .model, or a HuggingFace tokenizer.json / directory.")
    tiktoken_pattern: str | None = option(
        None, choices=("v1", "v2"), help="TikTokenizer's pre-tokenization pattern: v1 or v2.")
    tiktoken_num_special_tokens: int = option(
        1000, help="TikTokenizer: ids reserved for special tokens in front of the BPE ranks.")
    tokenizer_special_tokens: list[str] | None = option(
        None, flags=("--tokenizer-special-tokens", "--tiktoken-special-tokens"), nargs="+",
        help="TikTokenizer's named special tokens, first in the id space (must include <unk> <s> </s> "
             "<mask> <pad> <cls> <sep>, the default).")
    eod_mask_loss: bool = option(False, help="Do not train on end-of-document tokens.")
    reset_position_ids: bool = option(False, help="Restart position ids after each end-of-document token.")
    reset_attention_mask: bool = option(False, help="Block attention across documents inside one sample.")
    num_workers: int = option(2, help="Data loader worker processes.")
    create_attention_mask_in_dataloader: bool = option(
        True, flags=("--no-create-attention-mask-in-dataloader",), action="store_false",
        help="Let the data loader build attention masks (megafab builds one only for "
             "--reset-attention-mask; plain causal attention needs none).")
    mmap_bin_files: bool = option(
        True, flags=("--no-mmap-bin-files",), action="store_false",
        help="Memory-map the .bin files; --no-mmap-bin-files reads each sample with a file read instead.")


@dataclass
class TrainingConfig(Section):
    micro_batch_size: int | None = option(None, help="Samples per micro-batch per data-parallel rank.")
    global_batch_size: int | None = option(
        None, help="Samples per optimizer step over all ranks; default micro_batch_size * dp.")
    num_micro_batches: int | None = derived(
        None, help="Derived: global_batch_size / (micro_batch_size * dp).")
    train_iters: int | None = option(None, help="Optimizer steps to train.")
    train_samples: int | None = option(None, help="Samples to train (alternative to train_iters).")
    eval_iters: int = option(100, help="Batches per evaluation.")
    eval_interval: int = option(1000, help="Evaluate every this many iterations.")
    skip_train: bool = option(False, help="Only evaluate.")
    exit_interval: int | None = option(None, help="Exit after an iteration divisible by this.")
    exit_duration_in_mins: float | None = option(
        None, help="Exit (with a checkpoint) after this many minutes.")
    exit_signal_handler: bool = option(False, help="On SIGTERM save a checkpoint and exit cleanly.")
    seed: int = option(1234, help="Seed of initialization, dropout and data shuffling.")
    rampup_batch_size: list[int] | None = option(
        None, nargs="*",
        flag_help="START INCREMENT SAMPLES",
        help="START INCREMENT SAMPLES: the global batch starts at START and grows by INCREMENT in equal "
             "steps over SAMPLES consumed samples up to --global-batch-size (needs --train-samples).")
    calculate_per_token_loss: bool = option(
        False,
        help="Average the loss over every token of the global batch (sum of losses / number of tokens over"
             " micro-batches and data-parallel ranks) instead of averaging per-micro-batch means.")
    check_for_nan_in_loss_and_grad: bool = option(
        True, action="store_true", negation="--no-check-for-nan-in-loss-and-grad",
        help="Stop at the first iteration whose loss or gradient norm is nan or inf (Megatron's check); "
             "off, such iterations are skipped. fp16 loss-scale overflows are skipped either way.")
    max_consecutive_skipped_iterations: int = option(
        100,
        flag_help="megafab only: stop after this many skipped iterations in a row (0: never)",
        help="megafab: stop after this many skipped iterations in a row (0: never).")
    manual_gc: bool = option(
        False,
        help="Disable Python's automatic garbage collector; collect at --manual-gc-interval and around "
             "evaluation instead, on every rank at the same step.")
    manual_gc_interval: int = option(
        0, help="With --manual-gc: collect every this many iterations (0: only around evaluation).")
    manual_gc_eval: bool = option(
        True, flags=("--no-manual-gc-eval", "--disable-manual-gc-eval"), action="store_false",
        help="With --manual-gc: collect before and after each evaluation (--no-manual-gc-eval turns it "
             "off).")
    empty_unused_memory_level: int = option(
        0, choices=(0, 1, 2),
        help="Release cached accelerator memory each iteration: 1 after forward-backward, 2 also after the"
             " optimizer step (CUDA only; CPU has no cache).")
    dry_run: bool = option(
        False,
        flag_help="megafab: check the flags and print the memory/FLOPs plan, start nothing",
        help="Validate the flags and print the memory/FLOPs plan without starting process groups.")


@dataclass
class CheckpointConfig(Section):
    save: str | None = option(None, help="Directory to save checkpoints to.")
    load: str | None = option(None, help="Directory to load a checkpoint from.")
    save_interval: int | None = option(
        None, flags=("--save-interval", "--persistent-save-interval"),
        help="Save every this many iterations (--persistent-save-interval is Megatron's other name).")
    no_save_optim: bool = option(False, help="Leave the optimizer state out of saved checkpoints.")
    no_save_rng: bool = option(False, help="Leave the RNG states out of saved checkpoints.")
    no_load_optim: bool = option(False, help="Do not load the optimizer state.")
    no_load_rng: bool = option(False, help="Do not load the RNG states.")
    finetune: bool = option(False, help="Load only the weights; restart iteration count and optimizer.")
    ckpt_format: str = option(
        "torch_dist",
        help="torch_dist: Megatron-LM's distributed checkpoint (any layout loads it, megatron-core too); "
             "torch: Megatron's legacy per-rank model_optim_rng.pt files.")
    auto_detect_ckpt_format: bool = option(
        False, help="Load whatever format the checkpoint has (torch_dist loads every format anyway).")
    ckpt_step: int | None = option(
        None, help="Load this iteration instead of the one the tracker file names.")
    pretrained_checkpoint: str | None = option(
        None, help="When --load holds no checkpoint, fine-tune from the one in this directory.")
    exit_on_missing_checkpoint: bool = option(
        False, help="Stop with an error when --load holds no checkpoint, instead of training from scratch.")


@dataclass
class LoggingConfig(Section):
    log_interval: int = option(100, help="Print the iteration line every this many iterations.")
    log_throughput: bool = option(False, help="Add TFLOP/s per GPU to the iteration line.")
    log_num_zeros_in_grad: bool = option(False, help="Count zeros in the gradients.")
    log_params_norm: bool = option(
        False, help="Add the L2 norm of all parameters (Megatron's calc_params_l2_norm, after the step) "
                    "to the iteration line (\" params norm: X |\"), the JSON line (params_norm) and "
                    "TensorBoard / wandb (\"params-norm\").")
    tensorboard_dir: str | None = option(None, help="Write TensorBoard scalars here.")
    tensorboard_log_interval: int = option(1, help="Write TensorBoard scalars every this many iterations.")
    wandb_project: str = option(
        "",
        help="Log to this wandb project: online, unless the environment's WANDB_MODE says otherwise "
             "(offline, disabled).")
    wandb_exp_name: str = option("", help="wandb run name.")
    wandb_save_dir: str = option("", help="wandb run directory.")
    logging_level: int | None = option(
        None, help="Python logging level of megafab's loggers (10 debug, 20 info, 30 warning).")
    profile: bool = option(
        False,
        help="Profile iterations --profile-step-start..--profile-step-end with torch.profiler; the trace "
             "goes to --tensorboard-dir (else --save, else ./profile).")
    use_pytorch_profiler: bool = option(
        False,
        help="Megatron's switch between nsys and torch.profiler: megafab always writes a torch.profiler "
             "trace; without this flag it also marks the range for nsys (cudaProfilerStart/Stop) on CUDA.")
    profile_step_start: int = option(10, help="First profiled iteration.")
    profile_step_end: int = option(12, help="Iteration at which profiling stops (not profiled).")
    profile_ranks: list[int] = option([0], nargs="+", help="Global ranks that profile.")
    timing_log_level: int = option(
        0, choices=(0, 1, 2),
        help="Timers printed after each iteration line (min and max over ranks, ms per iteration): 0 none "
             "(only the iteration time), 1 once-per-step operations (forward-backward, all-grads-sync, "
             "optimizer), 2 also per-micro-batch ones (forward-compute, backward-compute, pipeline "
             "send/recv, batch-generator), which synchronize the device and may slow the step.")
    timing_log_option: str = option(
        "minmax", choices=("max", "minmax", "all"),
        help="How timers are reported across ranks: max, minmax, or all (every rank's value).")
    log_timers_to_tensorboard: bool = option(
        False, help="Write the timers (as \"<name>-time\") and the iteration time to TensorBoard / wandb.")
    log_memory_to_tensorboard: bool = option(
        False,
        help="Write memory to TensorBoard: mem-allocated/max-allocated/reserved-bytes on CUDA, the "
             "process's mem-resident/max-resident-bytes on CPU.")
    log_validation_ppl_to_tensorboard: bool = option(
        False, help="Also write the validation perplexity to TensorBoard (\"lm loss validation ppl\").")
    log_world_size_to_tensorboard: bool = option(
        False, help="Write the number of processes to TensorBoard (\"world-size\").")
    log_loss_scale_to_tensorboard: bool = option(
        True, flags=("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard"),
        action="store_false",
        help="Write the loss scale to TensorBoard (\"loss-scale\").")
    tensorboard_queue_size: int = option(
        1000, help="TensorBoard events held in memory before a write to disk.")
    wandb_entity: str = option("", help="wandb entity (team or user) of the run.")
    metrics_jsonl: str | None = option(
        None,
        help="megafab: file that gets each iteration line (and each evaluation) also as one JSON object "
             "per line; default metrics.jsonl in --save, else in --tensorboard-dir, else none.")


SECTIONS = {"model": ModelConfig, "moe": MoEConfig, "parallel": ParallelConfig,
            "precision": PrecisionConfig, "optimizer": OptimizerConfig, "data": DataConfig,
            "training": TrainingConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig}


def flag_fields() -> list[tuple[str, dataclasses.Field]]:
    """(section name, field) of every field a flag sets, in declaration order."""
    return [(name, f) for name, section in SECTIONS.items() for f in dataclasses.fields(section)
            if not f.metadata.get("derived")]


@functools.cache
def field_docs() -> dict[str, str]:
    """{field name: its help text} for every field of every section."""
    return {f.name: f.metadata["help"] for section in SECTIONS.values() for f in dataclasses.fields(section)}
