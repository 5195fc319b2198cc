"""Typed configuration: one dataclass per concern, Megatron's names and defaults.

Field names equal the `dest` of Megatron's argparse flags (``--num-layers`` -> ``num_layers``), so a
Megatron user finds every knob under the name they know. `Config.finalize(world_size)` fills the
derived defaults the way Megatron computes them, then `validate()` collects every violation and
raises one ConfigError listing all of them with the values and the fix.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import textwrap
from dataclasses import dataclass, field

from megafab.errors import MegafabError
from megafab.pipeline_split import PipelineSplit


class ConfigError(MegafabError):
    """Every problem found in a configuration, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the configuration:\n{lines}")


@dataclass
class ModelConfig:
    num_layers: int | None = None
    """Number of transformer layers in the whole model (all pipeline stages together)."""
    hidden_size: int | None = None
    """Width of the residual stream, h."""
    ffn_hidden_size: int | None = None
    """MLP inner width; default 4h, or int((4h * 2/3) / 64) * 64 with --swiglu."""
    num_attention_heads: int | None = None
    """Number of query heads."""
    kv_channels: int | None = None
    """Width of one attention head; default hidden_size / num_attention_heads."""
    group_query_attention: bool = False
    """Share key/value heads among groups of query heads (GQA)."""
    num_query_groups: int | None = None
    """Number of key/value heads with GQA; equals num_attention_heads without it."""
    seq_length: int | None = None
    """Tokens per sample."""
    max_position_embeddings: int | None = None
    """Size of the learned position table; default seq_length."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute, rope or none."""
    rotary_base: int = 10000
    """RoPE base (theta)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates."""
    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm."""
    norm_epsilon: float = 1e-5
    """Epsilon of every norm."""
    swiglu: bool = False
    """SwiGLU MLP (gated SiLU) instead of GELU."""
    openai_gelu: bool = False
    """GELU in its tanh approximation (OpenAI GPT-2's gelu_new) instead of the exact erf GELU."""
    squared_relu: bool = False
    """relu(x)^2 as the MLP activation instead of GELU."""
    apply_layernorm_1p: bool = False
    """Zero-centered norm weight: every LayerNorm/RMSNorm computes norm(x) * (1 + weight) and its
    weight starts at 0 (megatron-core's layernorm_zero_centered_gamma)."""
    qk_layernorm: bool = False
    """Normalize each head's queries and keys (q_layernorm / k_layernorm over kv_channels, the
    --normalization type) before RoPE and attention."""
    apply_residual_connection_post_layernorm: bool = False
    """Take the residual from the norm's output instead of its input (the original BERT order)."""
    attention_backend: str = "auto"
    """Attention kernel: auto (PyTorch SDPA picks), flash, fused (cuDNN / memory-efficient, CUDA
    only), unfused or local (SDPA's math kernel)."""
    cross_entropy_loss_fusion: bool = False
    """Vocab-parallel cross entropy with the target logit and the sum of exponentials reduced over
    TP in one all-reduce instead of two (megatron-core's fused cross entropy); same values."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of reusing the word embedding."""
    add_bias_linear: bool = True
    """Biases in the linear layers (--disable-bias-linear turns them off)."""
    add_qkv_bias: bool = False
    """Bias in the QKV projection even when --disable-bias-linear is given."""
    hidden_dropout: float = 0.1
    """Dropout on the residual branches."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    init_method_std: float = 0.02
    """Std of the normal init; output projections use std / sqrt(2 * num_layers)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""
    vocab_size: int | None = None
    """Tokenizer vocabulary size (set from the tokenizer, or --vocab-size with NullTokenizer)."""
    padded_vocab_size: int | None = None
    """Derived: vocab_size padded to a multiple of make_vocab_size_divisible_by * tp."""
    recompute_granularity: str | None = None
    """Activation recompute: full or selective (core attention)."""
    recompute_method: str | None = None
    """With full recompute: uniform or block."""
    recompute_num_layers: int | None = None
    """Layers per recompute unit (uniform) or recomputed layers per stage (block)."""
    recompute_modules: list[str] | None = None
    """With selective recompute: which modules (core_attn is supported)."""
    transformer_impl: str = "local"
    """local (pure PyTorch) or transformer_engine (GPU only)."""
    compile_layers: bool = False
    """megafab's own --compile (not a Megatron flag): wrap each transformer layer in torch.compile."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP degree: ranks that split each layer's weights."""
    pipeline_model_parallel_size: int = 1
    """PP degree: stages the layers are split over."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per model chunk for the interleaved schedule."""
    num_virtual_stages_per_pipeline_rank: int | None = None
    """Model chunks per pipeline rank for the interleaved schedule (alternative to the above)."""
    decoder_first_pipeline_num_layers: int | None = None
    """Transformer layers on the first pipeline stage; the other stages share the rest evenly."""
    decoder_last_pipeline_num_layers: int | None = None
    """Transformer layers on the last pipeline stage; the other stages share the rest evenly."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting layers over stages: the first stage (its
    first virtual chunk) holds one transformer layer fewer."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer + loss as one layer when splitting: the last stage (its last virtual
    chunk) holds one transformer layer fewer."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Derived: model chunks per pipeline rank (vpp); None without interleaving."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in the non-TP regions (needs TP > 1)."""
    context_parallel_size: int = 1
    """CP degree: ranks that split every sequence; rank r holds chunks r and 2*cp-1-r of 2*cp
    (Megatron's causal load balancing) and attention is exact across them."""
    cp_comm_type: str = "p2p"
    """How CP attention exchanges keys/values: p2p (ring, partial results merged by log-sum-exp),
    allgather (all K/V gathered), a2a (DeepSpeed-Ulysses: heads scattered, sequence gathered)."""
    data_parallel_size: int | None = None
    """Derived: world_size / (tp * cp * pp)."""
    world_size: int | None = None
    """Derived: number of processes."""
    use_distributed_optimizer: bool = False
    """Shard fp32 main params and optimizer state across data-parallel ranks."""
    overlap_grad_reduce: bool = False
    """Start each gradient bucket's reduction during backward."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward."""
    ddp_bucket_size: int | None = None
    """Elements per gradient bucket; default max(40M, 1M * dp)."""
    gradient_accumulation_fusion: bool = True
    """Add the linear layers' weight gradients straight into the fp32 main-grad buffer (Megatron's
    default); --no-gradient-accumulation-fusion goes through param.grad and a hook instead."""
    accumulate_allreduce_grads_in_fp32: bool = True
    """Keep main gradients in fp32 for bf16/fp16 models (turned off by --grad-reduce-in-bf16)."""
    grad_reduce_in_bf16: bool = False
    """Accumulate and reduce gradients over data parallel in bf16 (the DDP grad buffer's dtype);
    the optimizer still steps fp32 main params."""
    distributed_backend: str | None = None
    """nccl or gloo; default nccl with CUDA, gloo without."""
    distributed_timeout_minutes: float = 10
    """Timeout of every collective; a frozen rank fails the others after this long (fractions of a
    minute are accepted)."""
    use_torch_fsdp2: bool = False
    """ZeRO-3 with torch FSDP2: parameters, gradients and optimizer state sharded over data-parallel
    ranks, one FSDP unit per transformer layer plus the embedding/output (weight gradients go
    through autograd: there is no main_grad buffer for gradient accumulation fusion)."""
    use_megatron_fsdp: bool = False
    """Megatron-FSDP's flag: megafab runs the --data-parallel-sharding-strategy it asks for with its
    own engines (DDP, the distributed optimizer, FSDP2), announced at start-up."""
    data_parallel_sharding_strategy: str | None = None
    """With --use-megatron-fsdp: no_shard (ZeRO-0, replicated), optim (ZeRO-1, the distributed
    optimizer), optim_grads (ZeRO-2: FSDP2 keeping gathered weights to the backward),
    optim_grads_params (ZeRO-3: FSDP2, Megatron's default)."""
    torch_fsdp2_reshard_after_forward: bool = True
    """FSDP2 frees each unit's gathered weights after its forward and gathers them again for the
    backward; --torch-fsdp2-no-reshard-after-forward keeps them (more memory, one all-gather less)."""
    fully_sharded: bool = False
    """Derived: FSDP2 runs (--use-torch-fsdp2, or --use-megatron-fsdp with optim_grads(_params))."""

    @property
    def fsdp_reshard_after_forward(self) -> bool:
        """Whether FSDP2 frees gathered weights after forward (ZeRO-3; not Megatron-FSDP's optim_grads)."""
        if self.use_megatron_fsdp and not self.use_torch_fsdp2:
            return self.data_parallel_sharding_strategy != "optim_grads"
        return self.torch_fsdp2_reshard_after_forward


@dataclass
class PrecisionConfig:
    fp16: bool = False
    """Train in fp16 with a loss scaler."""
    bf16: bool = False
    """Train in bf16."""
    loss_scale: float | None = None
    """Static loss scale for fp16; dynamic scaling when unset."""
    initial_loss_scale: float = 2.0**32
    """Starting dynamic loss scale."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale."""
    loss_scale_window: int = 1000
    """Clean steps before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves."""
    fp8_format: str | None = None
    """FP8 with Transformer Engine: e4m3 or hybrid."""
    fp8_recipe: str = "delayed"
    """TE recipe: delayed, tensorwise, mxfp8 or blockwise."""
    fp8_margin: int = 0
    """Margin of the FP8 scaling factor."""
    fp8_amax_history_len: int = 1
    """Length of the amax history window."""
    fp8_amax_compute_algo: str = "most_recent"
    """most_recent or max over the history."""

    @property
    def params_dtype_name(self) -> str:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    """adam (AdamW, decoupled weight decay) or sgd."""
    lr: float | None = None
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_decay_style: str = "linear"
    """constant, linear, cosine, inverse-square-root or WSD."""
    lr_decay_iters: int | None = None
    """Iterations to decay over; default train_iters."""
    lr_decay_samples: int | None = None
    """Samples to decay over; default train_samples."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the decay span."""
    lr_warmup_iters: int = 0
    """Warmup iterations."""
    lr_warmup_samples: int = 0
    """Warmup samples."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of warmup."""
    override_opt_param_scheduler: bool = False
    """On resume, run the learning-rate and weight-decay schedule the command line gives, not the
    checkpoint's (by default a difference between them stops the run, as in Megatron)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, keep the checkpoint's learning-rate and weight-decay schedule where the command line
    gives a different one."""
    lr_wsd_decay_style: str = "exponential"
    """Decay shape of the WSD schedule's final phase."""
    lr_wsd_decay_samples: int | None = None
    """Samples of WSD's final decay phase."""
    lr_wsd_decay_iters: int | None = None
    """Iterations of WSD's final decay phase."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norms)."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.9
    """SGD momentum."""
    decoupled_lr: float | None = None
    """Peak learning rate of the input embedding and the output layer (their own schedule)."""
    decoupled_min_lr: float | None = None
    """Final learning rate of the input embedding and the output layer; default --min-lr."""
    optimizer_cpu_offload: bool = False
    """Keep fp32 main params and Adam state in host memory and step them on the CPU (torch's
    fused/foreach AdamW); the device keeps the model weights and gradients."""
    optimizer_offload_fraction: float | None = None
    """Share of the optimizer state offloaded, in [0, 1]; default 1.0 with --optimizer-cpu-offload."""
    pin_cpu_grads: bool = True
    """Page-locked host gradient buffers for offload."""
    pin_cpu_params: bool = True
    """Page-locked host main params for offload."""
    use_precision_aware_optimizer: bool = False
    """Megatron's flag that its CPU offload requires; megafab accepts it with --optimizer-cpu-offload
    (fp32 main params and Adam moments, its default dtypes, are what megafab keeps)."""


@dataclass
class DataConfig:
    data_path: list[str] | None = None
    """Prefixes (optionally weighted: w1 p1 w2 p2) of .bin/.idx datasets split by --split."""
    split: str | None = None
    """Train/valid/test proportions over documents, e.g. 969,30,1."""
    train_data_path: list[str] | None = None
    """Separate training prefixes."""
    valid_data_path: list[str] | None = None
    """Separate validation prefixes."""
    test_data_path: list[str] | None = None
    """Separate test prefixes."""
    data_cache_path: str | None = None
    """Where the sample-index .npy caches live."""
    mock_data: bool = False
    """Random tokens, no files: for smoke tests and benchmarks."""
    tokenizer_type: str | None = None
    """GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer,
    HuggingFaceTokenizer or NullTokenizer."""
    vocab_file: str | None = None
    """GPT-2 vocab.json."""
    merge_file: str | None = None
    """GPT-2 merges.txt."""
    tokenizer_model: str | None = None
    """SentencePiece .model, or a HuggingFace tokenizer.json / directory."""
    tiktoken_pattern: str | None = None
    """TikTokenizer's pre-tokenization pattern: v1 or v2."""
    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: ids reserved for special tokens in front of the BPE ranks."""
    tokenizer_special_tokens: list[str] | None = None
    """TikTokenizer's named special tokens, first in the id space (must include <unk> <s> </s>
    <mask> <pad> <cls> <sep>, the default)."""
    eod_mask_loss: bool = False
    """Do not train on end-of-document tokens."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool = False
    """Block attention across documents inside one sample."""
    create_attention_mask_in_dataloader: bool = True
    """Let the data loader build attention masks (megafab builds one only for
    --reset-attention-mask; plain causal attention needs none)."""
    mmap_bin_files: bool = True
    """Memory-map the .bin files; --no-mmap-bin-files reads each sample with a file read instead."""
    num_workers: int = 2
    """Data loader worker processes."""


@dataclass
class TrainingConfig:
    micro_batch_size: int | None = None
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks; default micro_batch_size * dp."""
    num_micro_batches: int | None = None
    """Derived: global_batch_size / (micro_batch_size * dp)."""
    train_iters: int | None = None
    """Optimizer steps to train."""
    train_samples: int | None = None
    """Samples to train (alternative to train_iters)."""
    eval_iters: int = 100
    """Batches per evaluation."""
    eval_interval: int = 1000
    """Evaluate every this many iterations."""
    skip_train: bool = False
    """Only evaluate."""
    exit_interval: int | None = None
    """Exit after an iteration divisible by this."""
    exit_duration_in_mins: float | None = None
    """Exit (with a checkpoint) after this many minutes."""
    exit_signal_handler: bool = False
    """On SIGTERM save a checkpoint and exit cleanly."""
    seed: int = 1234
    """Seed of initialization, dropout and data shuffling."""
    rampup_batch_size: list[int] | None = None
    """START INCREMENT SAMPLES: the global batch starts at START and grows by INCREMENT in equal
    steps over SAMPLES consumed samples up to --global-batch-size (needs --train-samples)."""
    calculate_per_token_loss: bool = False
    """Average the loss over every token of the global batch (sum of losses / number of tokens over
    micro-batches and data-parallel ranks) instead of averaging per-micro-batch means."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop at the first iteration whose loss or gradient norm is nan or inf (Megatron's check);
    off, such iterations are skipped. fp16 loss-scale overflows are skipped either way."""
    max_consecutive_skipped_iterations: int = 100
    """megafab: stop after this many skipped iterations in a row (0: never)."""
    manual_gc: bool = False
    """Disable Python's automatic garbage collector; collect at --manual-gc-interval and around
    evaluation instead, on every rank at the same step."""
    manual_gc_interval: int = 0
    """With --manual-gc: collect every this many iterations (0: only around evaluation)."""
    manual_gc_eval: bool = True
    """With --manual-gc: collect before and after each evaluation (--no-manual-gc-eval turns it off)."""
    empty_unused_memory_level: int = 0
    """Release cached accelerator memory each iteration: 1 after forward-backward, 2 also after the
    optimizer step (CUDA only; CPU has no cache)."""
    dry_run: bool = False
    """Validate the flags and print the memory/FLOPs plan without starting process groups."""


@dataclass
class CheckpointConfig:
    save: str | None = None
    """Directory to save checkpoints to."""
    load: str | None = None
    """Directory to load a checkpoint from."""
    save_interval: int | None = None
    """Save every this many iterations."""
    no_save_optim: bool = False
    """Leave the optimizer state out of saved checkpoints."""
    no_save_rng: bool = False
    """Leave the RNG states out of saved checkpoints."""
    no_load_optim: bool = False
    """Do not load the optimizer state."""
    no_load_rng: bool = False
    """Do not load the RNG states."""
    finetune: bool = False
    """Load only the weights; restart iteration count and optimizer."""
    ckpt_format: str = "torch_dist"
    """torch_dist: Megatron-LM's distributed checkpoint (any layout loads it, megatron-core too);
    torch: Megatron's legacy per-rank model_optim_rng.pt files."""
    auto_detect_ckpt_format: bool = False
    """Load whatever format the checkpoint has (torch_dist loads every format anyway)."""
    ckpt_step: int | None = None
    """Load this iteration instead of the one the tracker file names."""
    pretrained_checkpoint: str | None = None
    """When --load holds no checkpoint, fine-tune from the one in this directory."""
    exit_on_missing_checkpoint: bool = False
    """Stop with an error when --load holds no checkpoint, instead of training from scratch."""


@dataclass
class LoggingConfig:
    log_interval: int = 100
    """Print the iteration line every this many iterations."""
    log_throughput: bool = False
    """Add TFLOP/s per GPU to the iteration line."""
    log_num_zeros_in_grad: bool = False
    """Count zeros in the gradients."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here."""
    tensorboard_log_interval: int = 1
    """Write TensorBoard scalars every this many iterations."""
    wandb_project: str = ""
    """Log to this wandb project: online, unless the environment's WANDB_MODE says otherwise (offline,
    disabled)."""
    wandb_exp_name: str = ""
    """wandb run name."""
    wandb_save_dir: str = ""
    """wandb run directory."""
    logging_level: int | None = None
    """Python logging level of megafab's loggers (10 debug, 20 info, 30 warning)."""
    profile: bool = False
    """Profile iterations --profile-step-start..--profile-step-end with torch.profiler; the trace
    goes to --tensorboard-dir (else --save, else ./profile)."""
    use_pytorch_profiler: bool = False
    """Megatron's switch between nsys and torch.profiler: megafab always writes a torch.profiler
    trace; without this flag it also marks the range for nsys (cudaProfilerStart/Stop) on CUDA."""
    profile_step_start: int = 10
    """First profiled iteration."""
    profile_step_end: int = 12
    """Iteration at which profiling stops (not profiled)."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that profile."""
    timing_log_level: int = 0
    """Timers printed after each iteration line (min and max over ranks, ms per iteration): 0 none
    (only the iteration time), 1 once-per-step operations (forward-backward, all-grads-sync,
    optimizer), 2 also per-micro-batch ones (forward-compute, backward-compute, pipeline send/recv,
    batch-generator), which synchronize the device and may slow the step."""
    timing_log_option: str = "minmax"
    """How timers are reported across ranks: max, minmax, or all (every rank's value)."""
    log_timers_to_tensorboard: bool = False
    """Write the timers (as "<name>-time") and the iteration time to TensorBoard / wandb."""
    log_memory_to_tensorboard: bool = False
    """Write memory to TensorBoard: mem-allocated/max-allocated/reserved-bytes on CUDA, the process's
    mem-resident/max-resident-bytes on CPU."""
    log_validation_ppl_to_tensorboard: bool = False
    """Also write the validation perplexity to TensorBoard ("lm loss validation ppl")."""
    log_world_size_to_tensorboard: bool = False
    """Write the number of processes to TensorBoard ("world-size")."""
    log_loss_scale_to_tensorboard: bool = True
    """Write the loss scale to TensorBoard ("loss-scale")."""
    tensorboard_queue_size: int = 1000
    """TensorBoard events held in memory before a write to disk."""
    wandb_entity: str = ""
    """wandb entity (team or user) of the run."""
    metrics_jsonl: str | None = None
    """megafab: file that gets each iteration line (and each evaluation) also as one JSON object per
    line; default metrics.jsonl in --save, else in --tensorboard-dir, else none."""


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "precision": PrecisionConfig,
            "optimizer": OptimizerConfig, "data": DataConfig, "training": TrainingConfig,
            "checkpoint": CheckpointConfig, "logging": LoggingConfig}



@functools.cache
def field_docs() -> dict[str, str]:
    """{field name: its docstring on one line} for every field of every section (the --help text)."""
    docs = {}
    for section in SECTIONS.values():
        body = ast.parse(textwrap.dedent(inspect.getsource(section))).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


CKPT_FORMATS = ("torch_dist", "torch")  # Megatron's distributed and legacy checkpoint formats
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def swiglu_ffn_size(hidden_size: int) -> int:
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


# --cp-comm-type spellings -> the name megafab uses (Megatron says allgather).
CP_COMM_TYPES = {"p2p": "p2p", "allgather": "allgather", "all_gather": "allgather", "a2a": "a2a"}


def default_bucket_size(dp: int) -> int:
    return max(40_000_000, 1_000_000 * dp)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    notes: list[str] = field(default_factory=list)
    """Adjustments made while finalizing (e.g. sequence parallel turned off at TP 1)."""
    no_effect: list[str] = field(default_factory=list)
    """Flags accepted that change nothing here, each "--flag (why)"; printed once at start-up."""

    @classmethod
    def from_flat(cls, values: dict) -> Config:
        """Build from a flat {field_name: value} mapping such as vars(argparse.Namespace)."""
        sections = {}
        for name, section_cls in SECTIONS.items():
            names = {f.name for f in dataclasses.fields(section_cls)}
            sections[name] = section_cls(**{k: v for k, v in values.items() if k in names})
        return cls(**sections)

    def to_flat(self) -> dict:
        flat = {}
        for name in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat

    def finalize(self, world_size: int, validate: bool = True) -> Config:
        """Fill derived defaults as Megatron does, then (validate=True) check everything at once."""
        m, p, t, o = self.model, self.parallel, self.training, self.optimizer
        p.world_size = world_size
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        cp = p.context_parallel_size
        if tp >= 1 and pp >= 1 and cp >= 1 and world_size % (tp * cp * pp) == 0:
            p.data_parallel_size = world_size // (tp * cp * pp)
        p.cp_comm_type = CP_COMM_TYPES.get(p.cp_comm_type, p.cp_comm_type)
        if m.hidden_size and m.ffn_hidden_size is None:
            m.ffn_hidden_size = swiglu_ffn_size(m.hidden_size) if m.swiglu else 4 * m.hidden_size
        if m.hidden_size and m.num_attention_heads and m.kv_channels is None \
                and m.hidden_size % m.num_attention_heads == 0:
            m.kv_channels = m.hidden_size // m.num_attention_heads
        if not m.group_query_attention:
            m.num_query_groups = m.num_attention_heads
        if m.max_position_embeddings is None:
            m.max_position_embeddings = m.seq_length
        if m.vocab_size and tp >= 1:
            m.padded_vocab_size = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
        if p.num_virtual_stages_per_pipeline_rank is not None:
            p.virtual_pipeline_model_parallel_size = p.num_virtual_stages_per_pipeline_rank
        elif p.num_layers_per_virtual_pipeline_stage and m.num_layers and pp >= 1:
            # Megatron counts the embedding/loss "layers" here too
            split_layers = m.num_layers + p.account_for_embedding_in_pipeline_split \
                + p.account_for_loss_in_pipeline_split
            if split_layers % (pp * p.num_layers_per_virtual_pipeline_stage) == 0:
                p.virtual_pipeline_model_parallel_size = (
                    split_layers // pp // p.num_layers_per_virtual_pipeline_stage)
        if p.sequence_parallel and tp == 1:
            p.sequence_parallel = False
            self.notes.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1; "
                              "turned it off (as Megatron does)")
        if t.global_batch_size is None and t.micro_batch_size and p.data_parallel_size:
            t.global_batch_size = t.micro_batch_size * p.data_parallel_size
        if t.global_batch_size and t.micro_batch_size and p.data_parallel_size \
                and t.global_batch_size % (t.micro_batch_size * p.data_parallel_size) == 0:
            t.num_micro_batches = t.global_batch_size // (t.micro_batch_size * p.data_parallel_size)
        if o.lr_decay_iters is None and o.lr_decay_samples is None:
            o.lr_decay_iters, o.lr_decay_samples = t.train_iters, t.train_samples
        d = self.data
        if d.tokenizer_type is None and d.vocab_file and d.merge_file:
            d.tokenizer_type = "GPT2BPETokenizer"
            self.notes.append("--vocab-file and --merge-file without --tokenizer-type: using "
                              "GPT2BPETokenizer (as Megatron-LM's GPT-3 example scripts assume)")
        if p.grad_reduce_in_bf16:  # Megatron's rule: the grad buffer takes the (bf16) param dtype
            p.accumulate_allreduce_grads_in_fp32 = False
        resolve_sharding(self)
        if p.ddp_bucket_size is None and p.data_parallel_size and not p.fully_sharded:
            p.ddp_bucket_size = default_bucket_size(p.data_parallel_size)
        if validate:
            self.validate()
        return self

    def problems(self) -> list[str]:
        """Every rule this configuration breaks, one line each."""
        return (model_problems(self) + parallel_problems(self) + context_parallel_problems(self)
                + precision_problems(self) + training_problems(self) + data_problems(self)
                + checkpoint_problems(self) + sharding_problems(self))

    def validate(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    def start_up_notes(self) -> list[str]:
        """What rank 0 prints once at start-up: adjustments, then every flag that has no effect."""
        lines = list(self.notes)
        if self.no_effect:
            lines.append("accepted, no effect in megafab: " + "; ".join(self.no_effect))
        return lines


def _required(cfg_section, names: list[str]) -> list[str]:
    return [f"--{n.replace('_', '-')} is required" for n in names if getattr(cfg_section, n) is None]


def model_problems(cfg: Config) -> list[str]:
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    out = _required(m, ["num_layers", "hidden_size", "num_attention_heads", "seq_length"])
    heads, groups = m.num_attention_heads, m.num_query_groups
    if heads and tp >= 1 and heads % tp:
        out.append(f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size "
                   f"{tp}; each TP rank must hold whole heads: pick a TP size that divides {heads}")
    if m.group_query_attention and groups is None:
        out.append("--group-query-attention needs --num-query-groups")
    if groups and heads and heads % groups:
        out.append(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    if m.group_query_attention and groups and tp >= 1 and groups % tp:
        out.append(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}; "
                   f"each TP rank must hold whole key/value groups: use a TP size that divides {groups}")
    if m.hidden_size and heads and m.kv_channels is None and m.hidden_size % heads:
        out.append(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {heads}; "
                   f"give --kv-channels explicitly or change one of them")
    if m.seq_length and m.max_position_embeddings and m.seq_length > m.max_position_embeddings:
        out.append(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                   f"{m.max_position_embeddings}; raise --max-position-embeddings or shorten sequences")
    if m.position_embedding_type not in ("learned_absolute", "rope", "none"):
        out.append(f"--position-embedding-type {m.position_embedding_type!r} is not one of "
                   f"learned_absolute, rope, none")
    if m.normalization not in ("LayerNorm", "RMSNorm"):
        out.append(f"--normalization {m.normalization!r} is not LayerNorm or RMSNorm")
    if not 0.0 < m.rotary_percent <= 1.0:
        out.append(f"--rotary-percent {m.rotary_percent} must be in (0, 1]")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(m, name) < 1.0:
            out.append(f"--{name.replace('_', '-')} {getattr(m, name)} must be in [0, 1)")
    if m.recompute_granularity not in (None, "full", "selective"):
        out.append(f"--recompute-granularity {m.recompute_granularity!r} is not full or selective")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        out.append("--recompute-method needs --recompute-granularity full")
    if m.recompute_granularity == "full" and m.recompute_method not in ("uniform", "block"):
        out.append("--recompute-granularity full needs --recompute-method uniform or block")
    if m.recompute_granularity == "full" and m.recompute_method and not m.recompute_num_layers:
        out.append("--recompute-granularity full needs --recompute-num-layers")
    unsupported = [name for name in (m.recompute_modules or []) if name != "core_attn"]
    if unsupported:
        out.append(f"--recompute-modules {' '.join(unsupported)} not supported by megafab (only core_attn); "
                   f"use --recompute-modules core_attn or --recompute-granularity full")
    if m.recompute_modules and m.recompute_granularity != "selective":
        out.append("--recompute-modules needs --recompute-granularity selective")
    if m.transformer_impl not in ("local", "transformer_engine"):
        out.append(f"--transformer-impl {m.transformer_impl!r} is not local or transformer_engine")
    activations = [f for f, on in (("--swiglu", m.swiglu), ("--squared-relu", m.squared_relu),
                                   ("--openai-gelu", m.openai_gelu)) if on]
    if len(activations) > 1:
        out.append(f"{' and '.join(activations)} each choose the MLP activation; give one of them")
    if m.attention_backend not in ATTENTION_BACKENDS:
        out.append(f"--attention-backend {m.attention_backend!r} is not one of "
                   f"{', '.join(ATTENTION_BACKENDS)}")
    del pp
    return out


def parallel_problems(cfg: Config) -> list[str]:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, pp, world = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.world_size
    cp = p.context_parallel_size
    out = []
    for name, value in (("tensor-model-parallel-size", tp), ("pipeline-model-parallel-size", pp),
                        ("context-parallel-size", cp)):
        if value < 1:
            out.append(f"--{name} {value} must be at least 1")
    if world and tp >= 1 and pp >= 1 and cp >= 1 and world % (tp * cp * pp):
        cp_part = f"--context-parallel-size {cp} x " if cp > 1 else ""
        out.append(f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
                   f"{cp_part}--pipeline-model-parallel-size {pp} = {tp * cp * pp}; launch a multiple "
                   f"of {tp * cp * pp} processes or change the sizes")
    vpp = p.virtual_pipeline_model_parallel_size
    if p.num_layers_per_virtual_pipeline_stage and p.num_virtual_stages_per_pipeline_rank:
        out.append("give only one of --num-layers-per-virtual-pipeline-stage and "
                   "--num-virtual-stages-per-pipeline-rank")
    interleaved = p.num_layers_per_virtual_pipeline_stage or p.num_virtual_stages_per_pipeline_rank
    if interleaved and pp < 2:
        out.append("the interleaved schedule (virtual pipeline stages) needs "
                   "--pipeline-model-parallel-size of at least 2")
    if p.num_layers_per_virtual_pipeline_stage and m.num_layers and pp >= 1 and (
            m.num_layers + p.account_for_embedding_in_pipeline_split + p.account_for_loss_in_pipeline_split
    ) % (pp * p.num_layers_per_virtual_pipeline_stage):
        out.append(f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size "
                   f"{pp} x --num-layers-per-virtual-pipeline-stage "
                   f"{p.num_layers_per_virtual_pipeline_stage}")
    elif p.num_layers_per_virtual_pipeline_stage and (p.decoder_first_pipeline_num_layers is not None
                                                      or p.decoder_last_pipeline_num_layers is not None):
        out.append("uneven pipeline stages (--decoder-first/last-pipeline-num-layers) with virtual stages "
                   "need --num-virtual-stages-per-pipeline-rank, not --num-layers-per-virtual-pipeline-stage")
    elif m.num_layers and pp >= 1:
        out += PipelineSplit.from_config(cfg).problems()
    if interleaved and vpp and t.num_micro_batches and pp > 1 and t.num_micro_batches % pp:
        out.append(f"the interleaved schedule needs the number of micro-batches "
                   f"({t.num_micro_batches} = global batch / (micro batch x dp)) to be a multiple of "
                   f"--pipeline-model-parallel-size {pp}")
    if p.overlap_param_gather and not p.use_distributed_optimizer and not p.fully_sharded:
        out.append("--overlap-param-gather needs --use-distributed-optimizer")
    if not p.distributed_timeout_minutes > 0:
        out.append(f"--distributed-timeout-minutes {p.distributed_timeout_minutes} must be positive")
    if p.distributed_backend not in (None, "nccl", "gloo"):
        out.append(f"--distributed-backend {p.distributed_backend!r} is not nccl or gloo")
    return out


def context_parallel_problems(cfg: Config) -> list[str]:
    """What CP needs: whole chunks per rank, a known comm type, and heads that split for a2a."""
    m, p = cfg.model, cfg.parallel
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    out = []
    split = (2 * cp if cp > 1 else 1) * (tp if p.sequence_parallel else 1)
    if m.seq_length and split > 1 and m.seq_length % split:
        parts = ([f"2 x --context-parallel-size {cp}"] if cp > 1 else []) + \
            ([f"--tensor-model-parallel-size {tp} (--sequence-parallel)"] if p.sequence_parallel else [])
        out.append(f"--seq-length {m.seq_length} is not divisible by {' x '.join(parts)} = {split}; "
                   f"every rank must hold whole, equal sequence chunks: use a multiple of {split}")
    if " " in p.cp_comm_type:
        out.append(f"--cp-comm-type {p.cp_comm_type}: per-layer CP communication types are not "
                   f"supported by megafab yet; give one type for every layer")
    elif p.cp_comm_type not in CP_COMM_TYPES.values():
        out.append(f"--cp-comm-type {p.cp_comm_type!r} is not supported; use p2p, allgather or a2a "
                   f"(megafab has no hierarchical a2a+p2p)")
    if cp <= 1:
        return out
    heads, groups = m.num_attention_heads, m.num_query_groups
    if p.cp_comm_type == "a2a" and heads and groups and tp >= 1:
        counts = [("--num-attention-heads", heads)] + (
            [("--num-query-groups", groups)] if m.group_query_attention else [])
        for flag, value in counts:
            if value % tp == 0 and (value // tp) % cp:
                out.append(f"--cp-comm-type a2a scatters heads over CP ranks, but {flag} {value} / "
                           f"TP {tp} = {value // tp} is not divisible by --context-parallel-size {cp}; "
                           f"use --cp-comm-type p2p or allgather, or a CP size that divides {value // tp}")
    if m.transformer_impl == "transformer_engine":
        out.append("--context-parallel-size > 1 runs megafab's own CP attention, not Transformer "
                   "Engine's; use --transformer-impl local")
    if cfg.data.reset_attention_mask:
        out.append("--reset-attention-mask with --context-parallel-size > 1: CP attention is causal "
                   "over the whole sequence and takes no per-sample mask; drop --reset-attention-mask "
                   "or use --context-parallel-size 1")
    return out


def precision_problems(cfg: Config) -> list[str]:
    pr, m = cfg.precision, cfg.model
    out = []
    if pr.fp16 and pr.bf16:
        out.append("--fp16 and --bf16 were both given; choose one precision")
    if pr.fp8_format is not None:
        if pr.fp8_format not in ("e4m3", "hybrid"):
            out.append(f"--fp8-format {pr.fp8_format!r} is not e4m3 or hybrid")
        if m.transformer_impl != "transformer_engine":
            out.append("--fp8-format needs --transformer-impl transformer_engine (FP8 runs in "
                       "Transformer Engine's layers)")
        if not (pr.bf16 or pr.fp16):
            out.append("--fp8-format needs --bf16 (or --fp16) for the non-FP8 parts")
    if pr.loss_scale is not None and pr.loss_scale <= 0:
        out.append(f"--loss-scale {pr.loss_scale} must be positive")
    if cfg.parallel.grad_reduce_in_bf16 and not pr.bf16:
        out.append("--grad-reduce-in-bf16 needs --bf16 (gradients of fp32/fp16 models are reduced in "
                   "fp32); add --bf16 or drop --grad-reduce-in-bf16")
    return out


def training_problems(cfg: Config) -> list[str]:
    t, p, o = cfg.training, cfg.parallel, cfg.optimizer
    out = _required(t, ["micro_batch_size"])
    dp = p.data_parallel_size
    if t.micro_batch_size and dp and t.global_batch_size and \
            t.global_batch_size % (t.micro_batch_size * dp):
        out.append(f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
                   f"{t.micro_batch_size} x data-parallel size {dp} = {t.micro_batch_size * dp}; use a "
                   f"multiple of {t.micro_batch_size * dp}")
    if t.train_iters is not None and t.train_samples is not None:
        out.append("give only one of --train-iters and --train-samples")
    if not t.dry_run and not t.skip_train and t.train_iters is None and t.train_samples is None:
        out.append("--train-iters (or --train-samples) is required to train")
    if not t.skip_train and o.lr is None and not t.dry_run:
        out.append("--lr is required")
    warmups = [n for n, v in (("--lr-warmup-fraction", o.lr_warmup_fraction),
                              ("--lr-warmup-iters", o.lr_warmup_iters),
                              ("--lr-warmup-samples", o.lr_warmup_samples)) if v]
    if len(warmups) > 1:
        out.append(f"give only one of {', '.join(warmups)}")
    gbs = t.global_batch_size
    if gbs:
        decay = o.lr_decay_samples or (o.lr_decay_iters or 0) * gbs
        warmup = int(o.lr_warmup_fraction * decay) if o.lr_warmup_fraction is not None else \
            (o.lr_warmup_samples or o.lr_warmup_iters * gbs)
        if decay and warmup >= decay:
            out.append(f"the learning-rate warmup ({warmup} samples) is not shorter than the decay "
                       f"({decay} samples = --lr-decay-iters/--train-iters x global batch {gbs}); "
                       f"shorten the warmup or lengthen --lr-decay-iters")
    if o.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root", "WSD"):
        out.append(f"--lr-decay-style {o.lr_decay_style!r} is not constant, linear, cosine, "
                   f"inverse-square-root or WSD")
    if o.optimizer not in ("adam", "sgd"):
        out.append(f"--optimizer {o.optimizer!r} is not adam or sgd")
    if t.max_consecutive_skipped_iterations < 0:
        out.append(f"--max-consecutive-skipped-iterations {t.max_consecutive_skipped_iterations} must be "
                   f"at least 0 (0: never stop for skipped iterations)")
    if t.eval_interval is not None and t.eval_interval <= 0:
        out.append(f"--eval-interval {t.eval_interval} must be positive")
    if o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler:
        out.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict "
                   "each other (the command line's schedule or the checkpoint's); give one")
    if o.decoupled_min_lr is not None and o.decoupled_lr is None:
        out.append("--decoupled-min-lr needs --decoupled-lr (the embedding/output-layer schedule it ends)")
    if o.decoupled_lr is not None and o.decoupled_min_lr is not None and o.decoupled_min_lr > o.decoupled_lr:
        out.append(f"--decoupled-min-lr {o.decoupled_min_lr} exceeds --decoupled-lr {o.decoupled_lr}")
    if t.manual_gc_interval < 0:
        out.append(f"--manual-gc-interval {t.manual_gc_interval} must be 0 (off) or positive")
    if t.empty_unused_memory_level not in (0, 1, 2):
        out.append(f"--empty-unused-memory-level {t.empty_unused_memory_level} is not 0, 1 or 2")
    out += rampup_problems(cfg)
    out += profile_problems(cfg)
    return out


def rampup_problems(cfg: Config) -> list[str]:
    """Megatron's rules for --rampup-batch-size START INCREMENT SAMPLES."""
    t, p = cfg.training, cfg.parallel
    if t.rampup_batch_size is None:
        return []
    if len(t.rampup_batch_size) != 3:
        return [f"--rampup-batch-size takes 3 values (START INCREMENT SAMPLES), got "
                f"{' '.join(map(str, t.rampup_batch_size))}"]
    start, incr, samples = t.rampup_batch_size
    out = []
    if t.train_iters is not None:
        out.append("--rampup-batch-size needs sample-based training: give --train-samples (and "
                   "--lr-decay-samples / --lr-warmup-samples) instead of --train-iters, as Megatron requires")
    if start <= 0 or incr <= 0 or samples < 0:
        out.append(f"--rampup-batch-size {start} {incr} {samples}: START and INCREMENT must be "
                   f"positive and SAMPLES not negative")
        return out
    gbs, step = t.global_batch_size, (t.micro_batch_size or 0) * (p.data_parallel_size or 0)
    if gbs and (gbs < start or (gbs - start) % incr):
        out.append(f"--rampup-batch-size {start} {incr} {samples}: --global-batch-size {gbs} must be "
                   f"START plus a whole number of INCREMENTs")
    for name, value in (("START", start), ("INCREMENT", incr)):
        if step and value % step:
            out.append(f"--rampup-batch-size {name} {value} is not divisible by --micro-batch-size x "
                       f"data-parallel size = {step}; every ramp step must be whole micro-batches per rank")
    interleaved = (p.virtual_pipeline_model_parallel_size or 1) > 1
    pp = p.pipeline_model_parallel_size
    if interleaved and step and any((v // step) % pp for v in (start, incr)):
        out.append(f"--rampup-batch-size {start} {incr}: with the interleaved schedule every ramp step's "
                   f"micro-batch count must be a multiple of --pipeline-model-parallel-size {pp}")
    return out


def profile_problems(cfg: Config) -> list[str]:
    lg, world = cfg.logging, cfg.parallel.world_size
    if not lg.profile:
        return []
    out = []
    if not 0 <= lg.profile_step_start < lg.profile_step_end:
        out.append(f"--profile-step-start {lg.profile_step_start} must be before --profile-step-end "
                   f"{lg.profile_step_end}")
    outside = [r for r in lg.profile_ranks if world and not 0 <= r < world]
    if outside:
        out.append(f"--profile-ranks {' '.join(map(str, outside))}: not a rank of this {world}-process job")
    return out


def data_problems(cfg: Config) -> list[str]:
    d, m, t = cfg.data, cfg.model, cfg.training
    out = []
    needs_data = not t.dry_run and not d.mock_data
    has_paths = d.data_path or d.train_data_path
    if needs_data and not has_paths:
        out.append("no training data: give --data-path (or --train-data-path), or --mock-data")
    if d.data_path and d.train_data_path:
        out.append("give either --data-path or --train-data-path/--valid-data-path/--test-data-path")
    kind = d.tokenizer_type
    if kind in ("GPT2BPETokenizer",):
        for flag, value in (("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)):
            if value is None:
                out.append(f"--tokenizer-type {kind} needs {flag}")
            elif not os.path.exists(value):
                out.append(f"{flag} {value}: no such file")
    elif kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                  "HuggingFaceTokenizer"):
        if d.tokenizer_model is None:
            out.append(f"--tokenizer-type {kind} needs --tokenizer-model")
        elif not os.path.exists(d.tokenizer_model):
            out.append(f"--tokenizer-model {d.tokenizer_model}: no such file or directory")
    elif kind == "TikTokenizer":
        if d.tokenizer_model is None:
            out.append("--tokenizer-type TikTokenizer needs --tokenizer-model (Megatron's tiktoken "
                       "vocabulary .json)")
        elif not os.path.exists(d.tokenizer_model):
            out.append(f"--tokenizer-model {d.tokenizer_model}: no such file")
        if d.tiktoken_pattern is None:
            out.append("--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2")
    elif kind == "NullTokenizer":
        if m.vocab_size is None:
            out.append("--tokenizer-type NullTokenizer needs --vocab-size")
    elif kind is not None:
        out.append(f"--tokenizer-type {kind!r} is not one of GPT2BPETokenizer, SentencePieceTokenizer, "
                   f"GPTSentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer, TikTokenizer, "
                   f"NullTokenizer")
    elif needs_data or d.mock_data:
        if m.vocab_size is None:
            out.append("no tokenizer: give --tokenizer-type (or --vocab-size with --mock-data)")
    if d.tokenizer_special_tokens and kind != "TikTokenizer":
        out.append(f"--tokenizer-special-tokens is implemented for --tokenizer-type TikTokenizer only, not "
                   f"{kind}; drop it")
    if d.tiktoken_pattern not in (None, "v1", "v2"):
        out.append(f"--tiktoken-pattern {d.tiktoken_pattern!r} is not v1 or v2")
    if d.reset_attention_mask and not d.create_attention_mask_in_dataloader:
        out.append("--reset-attention-mask needs the attention mask the data loader builds; drop "
                   "--no-create-attention-mask-in-dataloader (or --reset-attention-mask)")
    out += data_path_problems(cfg)
    return out


def data_path_problems(cfg: Config) -> list[str]:
    """Each data-path flag parses (megafab.data.blend_spec's rules) and names existing datasets."""
    from megafab.data.blend_spec import parse_blend, parse_split
    from megafab.data.errors import DataError

    d, out = cfg.data, []
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        try:
            blend = parse_blend(getattr(d, flag))
        except DataError as e:
            out.append(f"--{flag.replace('_', '-')}: {e}")
            continue
        for prefix in blend[0] if blend else []:
            if not os.path.exists(prefix + ".idx"):
                out.append(f"data prefix {prefix}: {prefix}.idx not found (a Megatron dataset is "
                           f"PREFIX.bin + PREFIX.idx, e.g. made by tools/preprocess_data.py)")
    if d.split is not None:
        try:
            parse_split(d.split)
        except DataError as e:
            out.append(str(e))
    return out


def checkpoint_problems(cfg: Config) -> list[str]:
    c = cfg.checkpoint
    out = []
    if c.save_interval and not c.save:
        out.append("--save-interval needs --save DIR")
    if c.save:
        problem = unwritable_directory(c.save)
        if problem:
            out.append(f"--save {c.save}: {problem} (found now, not at the first save)")
    if c.ckpt_format not in CKPT_FORMATS:
        out.append(f"--ckpt-format {c.ckpt_format!r} is not supported by megafab (it reads and writes "
                   f"{' and '.join(CKPT_FORMATS)})")
    elif c.ckpt_format == "torch" and c.save and not c.no_save_optim:
        out.append("--ckpt-format torch (Megatron's legacy files) is written without optimizer state: its "
                   "layout follows Megatron's parameter order and buffers, which no other layout reads; add "
                   "--no-save-optim, or save --ckpt-format torch_dist (the default, fully reshardable)")
    return out


def unwritable_directory(path: str) -> str | None:
    """Why `path` cannot be made and written as a directory, or None when it can."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    return None


# ---- ZeRO stages and optimizer offload ------------------------------------------------------------
MEGATRON_FSDP_STRATEGIES = {"no_shard": "ZeRO-0: replicated data parallelism",
                            "optim": "ZeRO-1: the distributed optimizer",
                            "optim_grads": "ZeRO-2's communication: torch FSDP2 keeping the gathered weights "
                                           "from forward to backward",
                            "optim_grads_params": "ZeRO-3: torch FSDP2"}


def resolve_sharding(cfg: Config) -> None:
    """Derive `fully_sharded` and the offload fraction; map Megatron-FSDP's strategies onto
    megafab's engines (with a note saying what runs)."""
    p, o = cfg.parallel, cfg.optimizer
    if o.optimizer_cpu_offload and o.optimizer_offload_fraction is None:
        o.optimizer_offload_fraction = 1.0
    p.fully_sharded = p.use_torch_fsdp2
    if not p.use_megatron_fsdp or p.use_torch_fsdp2:
        return
    strategy = p.data_parallel_sharding_strategy or "optim_grads_params"
    if strategy not in MEGATRON_FSDP_STRATEGIES:
        return  # refused in sharding_problems
    p.data_parallel_sharding_strategy = strategy
    asked_dist_opt = p.use_distributed_optimizer
    p.use_distributed_optimizer = strategy == "optim"
    p.fully_sharded = strategy in ("optim_grads", "optim_grads_params")
    note = (f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy} runs as "
            f"{MEGATRON_FSDP_STRATEGIES[strategy]}")
    if asked_dist_opt and strategy != "optim":
        note += " (--use-distributed-optimizer, which Megatron-FSDP requires, shards nothing more here)"
    cfg.notes.append(note)


def sharding_problems(cfg: Config) -> list[str]:
    p, o, pr, m = cfg.parallel, cfg.optimizer, cfg.precision, cfg.model
    out = []
    if p.use_torch_fsdp2 and p.use_megatron_fsdp:
        out.append("--use-torch-fsdp2 and --use-megatron-fsdp were both given; choose one (megafab runs "
                   "both with torch FSDP2)")
    if p.use_torch_fsdp2 and p.use_distributed_optimizer:
        out.append("--use-torch-fsdp2 and --use-distributed-optimizer cannot be combined: FSDP2 shards "
                   "the optimizer state itself (ZeRO-3 includes ZeRO-1); drop --use-distributed-optimizer")
    strategy = p.data_parallel_sharding_strategy
    if strategy is not None and strategy not in MEGATRON_FSDP_STRATEGIES:
        out.append(f"--data-parallel-sharding-strategy {strategy!r} is not one of "
                   f"{', '.join(MEGATRON_FSDP_STRATEGIES)}")
    elif strategy not in (None, "no_shard") and not p.use_megatron_fsdp:
        out.append(f"--data-parallel-sharding-strategy {strategy} needs --use-megatron-fsdp (with "
                   f"--use-torch-fsdp2, FSDP2 always shards parameters, gradients and optimizer state)")
    if not p.torch_fsdp2_reshard_after_forward and not p.use_torch_fsdp2:
        out.append("--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2 (with "
                   "--use-megatron-fsdp, --data-parallel-sharding-strategy optim_grads asks for it)")
    if p.fully_sharded:
        flag = "--use-torch-fsdp2" if p.use_torch_fsdp2 else "--use-megatron-fsdp"
        if p.overlap_param_gather and p.use_torch_fsdp2:
            out.append("--use-torch-fsdp2 and --overlap-param-gather cannot be combined: the flag is "
                       "the distributed optimizer's, and FSDP2 prefetches the next unit's all-gather "
                       "by itself; drop --overlap-param-gather")
        if p.ddp_bucket_size is not None:
            out.append(f"{flag} and --ddp-bucket-size cannot be combined: FSDP2 reduces one layer unit "
                       f"at a time, there are no DDP buckets; drop --ddp-bucket-size")
        if pr.fp8_format is not None:
            out.append(f"{flag} and --fp8-format cannot be combined in megafab yet (FSDP2 would gather "
                       f"16-bit weights for Transformer Engine's FP8 layers); drop one of them")
        if m.transformer_impl == "transformer_engine":
            out.append(f"{flag} and --transformer-impl transformer_engine cannot be combined in megafab "
                       f"yet; use --transformer-impl local with FSDP2")
        if m.compile_layers:
            out.append(f"{flag} and --compile cannot be combined in megafab yet; drop --compile")
        if cfg.checkpoint.ckpt_format == "torch" and cfg.checkpoint.save:
            out.append(f"{flag} and --ckpt-format torch cannot be combined with --save: Megatron's legacy "
                       f"files hold each TP rank's whole tensors, which FSDP2 keeps sharded over DP "
                       f"(writing them would gather them on one rank); save --ckpt-format torch_dist "
                       f"(the default, which loads at any DP size and without FSDP2)")
    fraction = o.optimizer_offload_fraction
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        out.append(f"--optimizer-offload-fraction {fraction} must be in [0, 1] (the share of the "
                   f"optimizer state kept on the CPU)")
    if not o.optimizer_cpu_offload:
        needs = [flag for flag, given in (
            ("--optimizer-offload-fraction", fraction is not None),
            ("--no-pin-cpu-grads", not o.pin_cpu_grads), ("--no-pin-cpu-params", not o.pin_cpu_params))
            if given]
        out += [f"{flag} needs --optimizer-cpu-offload" for flag in needs]
        if o.use_precision_aware_optimizer:
            out.append("--use-precision-aware-optimizer is not implemented in megafab on its own (its "
                       "non-fp32 main-param/moment dtypes are not); it is accepted only with "
                       "--optimizer-cpu-offload, whose code path Megatron routes through it")
    return out
