"""The configuration's rules for training, data, checkpoints and sharding: pure functions of the
values; each broken rule is one line."""

from __future__ import annotations

from megafab.checks.rules import required
from megafab.config.batch_schedule import parse_step_schedule
from megafab.config.schema import CKPT_FORMATS
from megafab.data.blend_spec import parse_blend, parse_split
from megafab.data.errors import DataError
from megafab.data.tokenizers import TOKENIZER_FILES

DATA_PATH_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def training_problems(cfg) -> list[str]:
    t, p, o = cfg.training, cfg.parallel, cfg.optimizer
    out = required(t, ["micro_batch_size"])
    if t.deterministic_mode and cfg.model.cross_entropy_loss_fusion:  # Megatron's determinism.py
        out.append("--deterministic-mode requires the unfused cross entropy: drop "
                   "--cross-entropy-loss-fusion")
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
    out += weight_hash_problems(t, p)
    out += rampup_problems(cfg)
    out += step_schedule_problems(cfg)
    out += eval_batch_problems(cfg)
    out += profile_problems(cfg)
    return out


def weight_hash_problems(t, p) -> list[str]:
    every = t.check_weight_hash_across_dp_replicas_interval
    if every is None:
        return []
    if every <= 0:
        return [f"--check-weight-hash-across-dp-replicas-interval {every} must be positive"]
    if p.fully_sharded:  # Megatron refuses it with Megatron-FSDP's optim_grads_params
        return ["--check-weight-hash-across-dp-replicas-interval with a fully sharded data-parallel engine "
                "(FSDP2, or Megatron-FSDP's optim_grads_params / optim_grads): the parameters are sharded "
                "across data-parallel ranks, not replicated; drop the flag or use the distributed optimizer"]
    return []


def step_schedule_problems(cfg) -> list[str]:
    """--step-batch-size-schedule: its own rules (config/batch_schedule.py), then with the layout.
    Megatron checks each step's batch against micro batch x dp when the step runs; a run without
    --load must fit all of them, a resumed one the batches after the first that fits (those before
    may lie behind it, with more DP ranks now; training/batch_size.py checks the resumed batch)."""
    t, p = cfg.training, cfg.parallel
    if t.step_batch_size_schedule is None:
        return []
    flag = f"--step-batch-size-schedule {t.step_batch_size_schedule!r}"
    try:
        schedule = parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
    except ValueError as e:
        return [f"{flag}: {e}"]
    out, final = [], schedule[-1][1]
    if t.rampup_batch_size is not None:
        out.append(f"{flag} and --rampup-batch-size are two batch-size ramps; give one (Megatron-LM HEAD "
                   f"ignores --rampup-batch-size)")
    smaller = [(a, b) for (_, a), (_, b) in zip(schedule, schedule[1:]) if b < a]
    if smaller:
        out.append(f"{flag}: batch {smaller[0][1]} after {smaller[0][0]}; the batch may only grow (Megatron "
                   f"asserts the number of micro-batches never decreases)")
    step = (t.micro_batch_size or 0) * (p.data_parallel_size or 0)
    gbs = t.global_batch_size
    if gbs not in (None, final, step):
        out.append(f"--global-batch-size {gbs} with {flag}: the schedule sets each step's batch (Megatron-LM "
                   f"refuses both flags); drop --global-batch-size, or give the schedule's last, {final}")
    if t.train_iters is not None and gbs != final:
        out.append(f"{flag} with --train-iters: the LR schedule's and the dataset's lengths count "
                   f"iterations of --global-batch-size samples, here micro batch x dp = {gbs}, not the "
                   f"schedule's batches; give --train-samples (and --lr-*-samples), or --global-batch-size "
                   f"{final}")
    if not step:
        return out
    batches = [b for _, b in schedule]
    fits = [b % step == 0 for b in batches]
    first = fits.index(True) if any(fits) and cfg.checkpoint.load else 0
    broken = [b for b, ok in zip(batches[first:], fits[first:]) if not ok]
    if broken:
        out.append(f"{flag}: batch {broken[0]} is not divisible by --micro-batch-size x data-parallel size "
                   f"= {step}; every step is whole micro-batches on each rank")
    pp = p.pipeline_model_parallel_size
    if (p.virtual_pipeline_model_parallel_size or 1) > 1 and any((b // step) % pp for b in batches[first:]):
        out.append(f"{flag}: with the interleaved schedule every batch's micro-batch count must be a "
                   f"multiple of --pipeline-model-parallel-size {pp}")
    return out


def eval_batch_problems(cfg) -> list[str]:
    """--eval-micro-batch-size / --eval-global-batch-size (Megatron HEAD's validate_args)."""
    t, p = cfg.training, cfg.parallel
    micro, gbs, dp = t.eval_micro_batch_size, t.eval_global_batch_size, p.data_parallel_size or 0
    bad = [f"--eval-{n}-batch-size {v} must be positive" for n, v in (("micro", micro), ("global", gbs))
           if v is not None and v <= 0]
    if bad or not (micro and gbs and dp) or (micro, gbs) == (t.micro_batch_size, t.global_batch_size):
        return bad  # (training's own batch: training_problems' rule says it)
    if gbs % (micro * dp):
        return [f"--eval-global-batch-size {gbs} is not divisible by --eval-micro-batch-size {micro} x "
                f"data-parallel size {dp} = {micro * dp}; use a multiple of {micro * dp}"]
    pp = p.pipeline_model_parallel_size
    if (p.virtual_pipeline_model_parallel_size or 1) > 1 and (gbs // (micro * dp)) % pp:
        return [f"the interleaved schedule needs the evaluation's micro-batches ({gbs // (micro * dp)} = "
                f"eval global batch / (eval micro batch x dp)) to be a multiple of "
                f"--pipeline-model-parallel-size {pp}"]
    return []


def rampup_problems(cfg) -> list[str]:
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


def profile_problems(cfg) -> list[str]:
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


def data_problems(cfg) -> list[str]:
    d, m, t = cfg.data, cfg.model, cfg.training
    out = []
    needs_data = not t.dry_run and not d.mock_data
    has_paths = d.data_path or d.train_data_path
    if needs_data and not has_paths:
        out.append("no training data: give --data-path (or --train-data-path), or --mock-data")
    if d.data_path and d.train_data_path:
        out.append("give either --data-path or --train-data-path/--valid-data-path/--test-data-path")
    kind = d.tokenizer_type
    out += [f"--tokenizer-type {kind} needs {flag} ({what})"
            for flag, name, what in TOKENIZER_FILES.get(kind, ()) if getattr(d, name) is None]
    if kind == "TikTokenizer":
        if d.tiktoken_pattern is None:
            out.append("--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2")
    elif kind == "NullTokenizer":
        if m.vocab_size is None:
            out.append("--tokenizer-type NullTokenizer needs --vocab-size")
    elif kind is None and (needs_data or d.mock_data):
        if m.vocab_size is None:
            out.append("no tokenizer: give --tokenizer-type (or --vocab-size with --mock-data)")
    if d.tokenizer_special_tokens and kind != "TikTokenizer":
        out.append(f"--tokenizer-special-tokens is implemented for --tokenizer-type TikTokenizer only, not "
                   f"{kind}; drop it")
    mask_made = d.create_attention_mask_in_dataloader or d.dataloader_inter_document_masking
    if d.reset_attention_mask and not mask_made:
        out.append("--reset-attention-mask needs the attention mask the data loader builds; drop "
                   "--no-create-attention-mask-in-dataloader (or --reset-attention-mask)")
    out += data_path_problems(cfg)
    return out


def data_path_problems(cfg) -> list[str]:
    """Each data-path flag and --split parses (megafab.data.blend_spec's rules)."""
    d, out = cfg.data, []
    for flag in DATA_PATH_FLAGS:
        try:
            parse_blend(getattr(d, flag))
        except DataError as e:
            out.append(f"--{flag.replace('_', '-')}: {e}")
    if d.split is not None:
        try:
            parse_split(d.split)
        except DataError as e:
            out.append(str(e))
    return out


def checkpoint_problems(cfg) -> list[str]:
    c = cfg.checkpoint
    out = []
    if c.ckpt_format not in CKPT_FORMATS:
        out.append(f"--ckpt-format {c.ckpt_format!r} is not supported by megafab (it reads and writes "
                   f"{', '.join(CKPT_FORMATS)})")
    elif c.ckpt_format == "torch" and c.save and not c.no_save_optim:
        out.append("--ckpt-format torch (Megatron's legacy files) is written without optimizer state: its "
                   "layout follows Megatron's parameter order and buffers, which no other layout reads; add "
                   "--no-save-optim, or save --ckpt-format torch_dist (the default, fully reshardable)")
    if c.ckpt_format == "fsdp_dtensor":
        out += _fsdp_dtensor_problems(cfg)
    if c.async_save and c.ckpt_format == "torch" and c.save:  # Megatron: NotImplementedError at the save
        out.append("--async-save with --ckpt-format torch: Megatron saves asynchronously only in torch_dist "
                   "(its legacy files are written synchronously); drop --async-save or save torch_dist")
    out += _non_persistent_problems(c)
    out += _retain_problems(c)
    if c.verify_integrity and c.ckpt_format != "torch_dist":  # Megatron's assert
        out.append(f"--verify-integrity works only with --ckpt-format torch_dist (not {c.ckpt_format}); drop "
                   f"one of them")
    return out


def _retain_problems(c) -> list[str]:
    """Megatron's asserts (with --save): a positive --save-retain-interval, a multiple of --save-interval."""
    keep, every = c.save_retain_interval, c.save_interval
    if keep is None or not c.save:
        return []
    if keep <= 0:
        return [f"--save-retain-interval {keep} must be positive (or left out: every checkpoint is kept)"]
    if every and keep % every:
        fit = every * max(1, keep // every)
        return [f"--save-retain-interval {keep} is not a multiple of --save-interval {every}; the retained "
                f"checkpoints must be ones that are saved (e.g. --save-retain-interval {fit})"]
    return []


def _fsdp_dtensor_problems(cfg) -> list[str]:
    """Megatron's rule (its arguments.py asserts it): fsdp_dtensor is Megatron-FSDP's format. Its
    converse (Megatron-FSDP saves only fsdp_dtensor) megafab does not hold: --use-megatron-fsdp runs
    on megafab's engines, which save torch_dist as well (every megafab layout loads it)."""
    if cfg.parallel.use_megatron_fsdp:
        return []
    return ["--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (Megatron's rule: it is Megatron-FSDP's "
            "checkpoint format); add --use-megatron-fsdp, or save --ckpt-format torch_dist (every layout "
            "loads it)"]


def _non_persistent_problems(c) -> list[str]:
    kind, out = c.non_persistent_ckpt_type, []
    if kind == "in_memory":
        out.append("--non-persistent-ckpt-type in_memory: checkpoints kept in memory without serialization "
                   "(unfinished in Megatron too) are not implemented in megafab; use local (a node-local "
                   "directory, --non-persistent-local-ckpt-dir) or global")
    elif kind in ("global", "local") and c.ckpt_format == "torch":
        out.append(f"--non-persistent-ckpt-type {kind} writes torch_dist checkpoints (Megatron's distributed "
                   f"format), not --ckpt-format torch; drop one of them")
    if kind == "local" and not c.non_persistent_local_ckpt_dir:  # Megatron's assert
        out.append("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir (the node-local "
                   "directory its checkpoints go to)")
    if c.non_persistent_save_interval and kind is None:
        out.append("--non-persistent-save-interval needs --non-persistent-ckpt-type global or local (where "
                   "the non-persistent checkpoints go)")
    no_dir = not (c.save or c.non_persistent_global_ckpt_dir)
    if c.non_persistent_save_interval and kind == "global" and no_dir:
        out.append("--non-persistent-save-interval needs --save (its checkpoints go to SAVE/non_persistent) "
                   "or --non-persistent-global-ckpt-dir")
    return out


def _model_dtype(pr) -> str:
    """The model's dtype as Megatron-FSDP's dtype flags spell it."""
    return "bf16" if pr.bf16 else "fp16" if pr.fp16 else "fp32"


def _megatron_fsdp_dtype_problems(p, pr) -> list[str]:
    """--megatron-fsdp-main-grads-dtype / --megatron-fsdp-grad-comm-dtype: Megatron-FSDP's only, and a
    16-bit one the model's own dtype (megafab reduces gradients in fp32 or in the model's dtype)."""
    given = [(flag, value) for flag, value in (
        ("--megatron-fsdp-main-grads-dtype", p.megatron_fsdp_main_grads_dtype),
        ("--megatron-fsdp-grad-comm-dtype", p.megatron_fsdp_grad_comm_dtype)) if value != "auto"]
    if given and not p.use_megatron_fsdp:
        return [f"{flag} {value} needs --use-megatron-fsdp (it sets Megatron-FSDP's gradient dtype); "
                f"use --grad-reduce-in-bf16 otherwise" for flag, value in given]
    model = _model_dtype(pr)
    return [f"{flag} {value} with a {model} model: megafab reduces gradients in fp32 or in the model's "
            f"dtype; use {model} or fp32" for flag, value in given if value not in ("fp32", model)]


def _megatron_fsdp_main_params_problems(p, pr, o) -> list[str]:
    """--megatron-fsdp-main-params-dtype: Megatron-FSDP's, on FSDP2's shards (optim_grads(_params)), fp32
    masters or the 16-bit model's own weights."""
    value = p.megatron_fsdp_main_params_dtype
    flag = f"--megatron-fsdp-main-params-dtype {value}"
    if value == "fp32":
        return []
    if not p.use_megatron_fsdp:
        return [f"{flag} needs --use-megatron-fsdp (it sets Megatron-FSDP's main params); drop it"]
    model = _model_dtype(pr)
    out = []
    if value not in ("auto", model):
        out.append(f"{flag} with a {model} model: megafab's main params are fp32 masters or the model's "
                   f"own weights; use fp32 or auto")
    if not p.fully_sharded:
        out.append(f"{flag} with --data-parallel-sharding-strategy {p.data_parallel_sharding_strategy}: "
                   f"megafab runs it with DDP / the distributed optimizer, whose main params are fp32; use "
                   f"optim_grads or optim_grads_params, or fp32")
    if o.optimizer_cpu_offload:
        out.append(f"{flag} with --optimizer-cpu-offload: the host keeps fp32 masters of an offloaded "
                   f"optimizer; drop one")
    return out


def sharding_problems(cfg) -> list[str]:
    p, o, pr, m = cfg.parallel, cfg.optimizer, cfg.precision, cfg.model
    out = []
    if p.use_torch_fsdp2 and p.use_megatron_fsdp:
        out.append("--use-torch-fsdp2 and --use-megatron-fsdp were both given; choose one (megafab runs "
                   "both with torch FSDP2)")
    if p.use_torch_fsdp2 and p.use_distributed_optimizer:
        out.append("--use-torch-fsdp2 and --use-distributed-optimizer cannot be combined: FSDP2 shards "
                   "the optimizer state itself (ZeRO-3 includes ZeRO-1); drop --use-distributed-optimizer")
    out += _megatron_fsdp_dtype_problems(p, pr)
    out += _megatron_fsdp_main_params_problems(p, pr, o)
    strategy = p.data_parallel_sharding_strategy
    if strategy not in (None, "no_shard") and not p.use_megatron_fsdp:
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
        if m.compile_layers:
            out.append(f"{flag} and --compile cannot be combined in megafab yet; drop --compile")
        if cfg.checkpoint.ckpt_format == "torch" and cfg.checkpoint.save:
            out.append(f"{flag} and --ckpt-format torch cannot be combined with --save: Megatron's legacy "
                       f"files hold each TP rank's whole tensors, which FSDP2 keeps sharded over DP "
                       f"(writing them would gather them on one rank); save --ckpt-format torch_dist "
                       f"(the default, which loads at any DP size and without FSDP2)")
    fraction = o.optimizer_offload_fraction
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
