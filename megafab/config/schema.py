"""The configuration's schema: one dataclass per concern, Megatron's names and defaults. Here: the
run's sections (precision, optimizer, data, training, checkpoint, logging) and SECTIONS, the list of
them all; the model's, the parallel layout's and MoE's are config/model.py, parallel.py and moe.py.

Field names equal the `dest` of Megatron's argparse flags (``--num-layers`` -> ``num_layers``). Each
field is declared once, with `option(...)`: its default, its help text and, where they differ from
what the field implies, its flag spellings, choices, nargs, action, negation flag and argparse
group; megafab/arguments.py builds the command line from these declarations and nothing else:

    window_size: int | None = option(None, help="Sliding attention window.")

gives `--window-size N`; a bool field with default False is a store_true flag (`negation="--no-x"`
adds a turning-off one). `derived(...)` fields have no flag: config/derive.py computes them. After
`Config.finalize` every section is frozen: assigning a field raises FrozenInstanceError.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megafab.config.fields import Section, derived, option
from megafab.config.model import ATTENTION_BACKENDS, ModelConfig
from megafab.config.moe import MoEConfig
from megafab.config.parallel import MEGATRON_FSDP_STRATEGIES, ParallelConfig

# Megatron's distributed, legacy and Megatron-FSDP checkpoint formats
CKPT_FORMATS = ("torch_dist", "torch", "fsdp_dtensor")
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer")


@dataclass
class PrecisionConfig(Section):
    fp16: bool = option(False, help="Train in fp16 with a loss scaler.")
    bf16: bool = option(False, help="Train in bf16.")
    disable_bf16_reduced_precision_matmul: bool = option(
        False,
        help="With --bf16, set torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False: "
             "cuBLAS then accumulates bf16 GEMMs without reduced-precision reductions (CPU math unchanged).")
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
    fp8_param_gather: bool = option(
        False, help="Keep Transformer Engine's linear weights in FP8 (1 byte each) and all-gather them in "
                    "FP8 (with --use-distributed-optimizer or FSDP2; fp32 main params).")

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
    trust_remote_code: bool = option(
        False, help="Whether or not to allow PreTrainedTokenizer to execute remote code (megafab reads "
                    "local tokenizer files only: the code in the --tokenizer-model directory).")
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
    dataloader_inter_document_masking: bool = option(
        False, help="Confine attention to each document of a sample (the .idx's documents) and restart "
                    "position ids in each; overrides --reset-position-ids / --reset-attention-mask.")
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
    deterministic_mode: bool = option(
        False, help="Bit-reproducible execution as Megatron's: NCCL_ALGO Ring, CUBLAS_WORKSPACE_CONFIG "
                    ":4096:8 and NVTE_ALLOW_NONDETERMINISTIC_ALGO 0 unless set (a value that is not "
                    "deterministic is refused), and torch.use_deterministic_algorithms(True).")
    eval_micro_batch_size: int | None = option(
        None, help="Micro batch size to use during evaluation (samples per micro-batch per data-parallel "
                   "rank); default --micro-batch-size.")
    eval_global_batch_size: int | None = option(
        None, help="Global batch size to use during evaluation (samples per evaluation batch); default "
                   "--global-batch-size. Must be divisible by eval micro batch size x data-parallel size.")
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
    step_batch_size_schedule: str | None = option(
        None,
        help='Step-wise global batch size by consumed tokens, "THRESHOLD:BS THRESHOLD:BS ..." (thresholds in '
             'tokens with an optional K, M, B or T suffix, the first 0), e.g. "0:768 250B:1536 500B:3072"; '
             'instead of --rampup-batch-size (megafab/config/batch_schedule.py).')
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
    check_weight_hash_across_dp_replicas_interval: int | None = option(
        None, help="Check every this many iterations (and at the start) that all data-parallel replicas hold "
                   "the same weights (SHA-1 of each parameter); a difference stops the job.")
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


# megatron-core's dist_checkpointing StrictHandling values
DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                        "return_unexpected", "return_all", "ignore_all")


@dataclass
class CheckpointConfig(Section):
    save: str | None = option(None, help="Directory to save checkpoints to.")
    load: str | None = option(None, help="Directory to load a checkpoint from.")
    save_interval: int | None = option(
        None, flags=("--save-interval", "--persistent-save-interval"),
        help="Save every this many iterations (--persistent-save-interval is Megatron's other name).")
    verify_integrity: bool = option(
        False, help="torch_dist saves also write integrity.json (each file's SHA-256, as Megatron's); loads "
                    "first check the files against it and stop at any difference.")
    save_retain_interval: int | None = option(
        None, help="Keep only the checkpoints of iterations that are multiples of this (and the latest): "
                   "each save deletes the one before it otherwise, as Megatron's. A multiple of "
                   "--save-interval.")
    no_save_optim: bool = option(False, help="Leave the optimizer state out of saved checkpoints.")
    no_save_rng: bool = option(False, help="Leave the RNG states out of saved checkpoints.")
    no_load_optim: bool = option(False, help="Do not load the optimizer state.")
    no_load_rng: bool = option(False, help="Do not load the RNG states.")
    finetune: bool = option(False, help="Load only the weights; restart iteration count and optimizer.")
    ckpt_format: str = option(
        "torch_dist",
        help="torch_dist: Megatron-LM's distributed checkpoint (any layout loads it, megatron-core too); "
             "torch: Megatron's legacy per-rank model_optim_rng.pt files; fsdp_dtensor: Megatron-FSDP's "
             "DCP state dict (with --use-megatron-fsdp).")
    auto_detect_ckpt_format: bool = option(
        False, help="Load whatever format the checkpoint has (torch_dist loads every format anyway).")
    ckpt_step: int | None = option(
        None, help="Load this iteration instead of the one the tracker file names.")
    pretrained_checkpoint: str | None = option(
        None, help="When --load holds no checkpoint, fine-tune from the one in this directory.")
    exit_on_missing_checkpoint: bool = option(
        False, help="Stop with an error when --load holds no checkpoint, instead of training from scratch.")
    use_checkpoint_args: bool = option(
        False, help="Take the model arguments the checkpoint in --load (or --pretrained-checkpoint) records "
                    "over the command line's, as Megatron's list of them: the sizes the command line "
                    "leaves unset, the rest always.")
    use_mp_args_from_checkpoint_args: bool = option(
        False, help="With --use-checkpoint-args, also the checkpoint's tensor, pipeline and expert parallel "
                    "sizes (its virtual-pipeline size, as in Megatron, is derived again from "
                    "--num-virtual-stages-per-pipeline-rank).")
    use_tokenizer_model_from_checkpoint_args: bool = option(
        True, flags=("--no-use-tokenizer-model-from-checkpoint-args",
                     "--disable-use-tokenizer-model-from-checkpoint-args"), action="store_false",
        help="the checkpoint's --tokenizer-type and --tokenizer-model, which --use-checkpoint-args "
             "otherwise takes too.")
    dist_ckpt_strictness: str = option(
        "assume_ok_unexpected", choices=DIST_CKPT_STRICTNESS,
        help="Determine handling of key mismatch during checkpoint load (torch_dist and megafab's DCP "
             "checkpoints; megatron-core's StrictHandling): 'unexpected' keys are the model's that the "
             "checkpoint lacks, 'missing' the checkpoint's that the model does not load. "
             "assume_ok_unexpected (default): an unexpected key stops the load; log_unexpected / "
             "log_all: warn of the unexpected (and missing) keys, the unexpected ones keep their "
             "initial values; raise_unexpected / raise_all: stop on the unexpected (or any) mismatch; "
             "return_unexpected / return_all / ignore_all: load without them, silently (Megatron hands "
             "return_*'s keys to load()'s caller, which a training run does not read).")
    strict_fsdp_dtensor_load: bool = option(
        True,
        flags=("--no-strict-fsdp-dtensor-load", "--disable-strict-fsdp-dtensor-load"),
        action="store_false",
        help="the strict load of an fsdp_dtensor checkpoint (every tensor the run needs must be in it); "
             "without it, Megatron's partial load: optimizer state the checkpoint lacks starts fresh (a "
             "warning names it), weights it lacks stop the load unless --finetune or a log_/return_/"
             "ignore_all --dist-ckpt-strictness keeps their initial values.")
    async_save: bool = option(
        False,
        help="Save torch_dist (or fsdp_dtensor) checkpoints asynchronously (with "
             "--use-persistent-ckpt-worker, which Megatron requires: without it Megatron saves "
             "synchronously): each rank copies what it owns to host memory and trains on while a "
             "background writer writes its files; the checkpoint becomes the latest only once every "
             "rank's files are written.")
    use_persistent_ckpt_worker: bool = option(
        False, help="Write --async-save checkpoints with one persistent background writer process per rank "
                    "(as Megatron's), which maps the rank's host staging memory.")
    non_persistent_save_interval: int | None = option(
        None, help="Save a non-persistent checkpoint every this many iterations (--non-persistent-ckpt-type "
                   "says where); a restart loads it when it is newer than the persistent one.")
    non_persistent_ckpt_type: str | None = option(
        None, choices=("global", "local", "in_memory"),
        help="global: a torch_dist checkpoint in --non-persistent-global-ckpt-dir (default "
             "SAVE/non_persistent), the older ones removed as the next starts; local: the same in the "
             "node-local --non-persistent-local-ckpt-dir (jobs on one node: megafab writes no per-rank "
             "format of its own); in_memory is not in megafab.")
    non_persistent_global_ckpt_dir: str | None = option(
        None, help="Directory of the global non-persistent checkpoints (default: non_persistent under --save "
                   "when saving, under --load when loading).")
    non_persistent_local_ckpt_dir: str | None = option(
        None, help="Node-local directory of the --non-persistent-ckpt-type local checkpoints.")


@dataclass
class LoggingConfig(Section):
    log_interval: int = option(100, help="Print the iteration line every this many iterations.")
    log_throughput: bool = option(False, help="Add TFLOP/s per GPU to the iteration line.")
    log_progress: bool = option(
        False, help="Append Megatron's progress lines to --save/progress.txt (rank 0): 'Starting job' at "
                    "start and, after each persistent save, the iteration, job and cumulative TFLOP/s/GPU, "
                    "floating-point operations so far and tokens.")
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


__all__ = ["ATTENTION_BACKENDS", "CKPT_FORMATS", "DECAY_STYLES", "MEGATRON_FSDP_STRATEGIES", "SECTIONS",
           "TOKENIZER_TYPES", "WSD_DECAY_STYLES", "CheckpointConfig", "DataConfig", "LoggingConfig",
           "ModelConfig", "MoEConfig", "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "Section",
           "TrainingConfig", "derived", "field_docs", "flag_fields", "option"]
