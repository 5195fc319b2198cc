"""Cross-field rules of a configuration: pure functions of its values, every violation one line.

`problems(cfg)` gathers them all, including the rules components own as `problems()` functions
(the pipeline split, the LR schedule, recompute, Transformer Engine's layer options, DDP buckets,
optimizer offload), so that one ConfigError lists everything a command line gets wrong before
anything is built. What needs the file system or the machine (data files, tokenizer files,
--save writable, TE installed, GPU capability) is a start-up check (config/probes.py and the
entry point's machine checks), not a rule.
"""

from __future__ import annotations

import dataclasses
import math

from megafab.config.derive import CP_COMM_TYPES, scheduler_samples
from megafab.config.schema import CKPT_FORMATS, SECTIONS
from megafab.distributed.topology import layout_problems
from megafab.pipeline_split import PipelineSplit

DATA_PATH_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def problems(cfg) -> list[str]:
    """Every rule `cfg` (resolved, see Config.resolve) breaks, one line each."""
    return (choice_problems(cfg) + model_problems(cfg) + component_problems(cfg) + parallel_problems(cfg)
            + moe_problems(cfg) + context_parallel_problems(cfg) + precision_problems(cfg)
            + training_problems(cfg) + data_problems(cfg) + checkpoint_problems(cfg) + sharding_problems(cfg))


def choice_problems(cfg) -> list[str]:
    """A value outside its field's choices (the parser refuses them; a config built in code may not)."""
    out = []
    for name in SECTIONS:
        if name == "moe":  # MoEConfig.problems() checks its own choices (the layer builds it in code too)
            continue
        section = getattr(cfg, name)
        for f in dataclasses.fields(section):
            choices, value = f.metadata.get("choices"), getattr(section, f.name)
            if choices is not None and value is not None and value not in choices:
                flag = (f.metadata.get("flags") or (f"--{f.name.replace('_', '-')}",))[0]
                out.append(f"{flag} {value!r} is not one of {', '.join(map(str, choices))}")
    return out


def component_problems(cfg) -> list[str]:
    """The rules the components own, asked with this configuration's values."""
    from megafab.distributed.data_parallel import bucket_size_problems
    from megafab.model.recompute import RecomputeSettings
    from megafab.model.te import te_layer_problems
    from megafab.optim.cpu_offload import offload_problems
    from megafab.optim.lr_scheduler import schedule_problems

    m, o, t, p = cfg.model, cfg.optimizer, cfg.training, cfg.parallel
    out = RecomputeSettings.from_model_config(m, check=False).problems()
    out += te_layer_problems(m)
    if o.optimizer_offload_fraction is not None:
        out += offload_problems(o.optimizer_offload_fraction)
    if p.ddp_bucket_size is not None and not p.fully_sharded:
        out += bucket_size_problems(p.ddp_bucket_size)
    if o.lr is not None:  # without a global batch size (a broken layout) the lengths are unknown
        lengths = scheduler_samples(o, t) if t.global_batch_size else {
            "lr_decay_samples": None, "wsd_decay_samples": o.lr_wsd_decay_samples or o.lr_wsd_decay_iters}
        out += schedule_problems(max_lr=o.lr, min_lr=o.min_lr, lr_decay_style=o.lr_decay_style,
                                 lr_wsd_decay_style=o.lr_wsd_decay_style, **lengths)
    return out


def _required(cfg_section, names: list[str]) -> list[str]:
    return [f"--{n.replace('_', '-')} is required" for n in names if getattr(cfg_section, n) is None]


def model_problems(cfg) -> list[str]:
    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
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
    if not 0.0 < m.rotary_percent <= 1.0:
        out.append(f"--rotary-percent {m.rotary_percent} must be in (0, 1]")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(m, name) < 1.0:
            out.append(f"--{name.replace('_', '-')} {getattr(m, name)} must be in [0, 1)")
    activations = [f for f, on in (("--swiglu", m.swiglu), ("--squared-relu", m.squared_relu),
                                   ("--openai-gelu", m.openai_gelu)) if on]
    if len(activations) > 1:
        out.append(f"{' and '.join(activations)} each choose the MLP activation; give one of them")
    return out


def parallel_problems(cfg) -> list[str]:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, pp, world = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.world_size
    cp = p.context_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    sizes = (tp, cp, pp, ep, tp if etp is None else etp)
    # Without a known world only the sizes themselves are checked: their product divides itself.
    out = layout_problems(world or max(1, math.prod(sizes)), tp, pp, cp, ep, etp)
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
    return out


def moe_problems(cfg) -> list[str]:
    """The MoE layer's own rules (MoEConfig.problems) and what Megatron asserts of MoE with the
    parallel layout: experts over EP, SP under TP, biases under ETP (the expert grid itself is
    topology.layout_problems, in parallel_problems)."""
    m, p, moe = cfg.model, cfg.parallel, cfg.moe
    tp, ep, etp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_tensor_parallel_size
    out = moe.problems(num_layers=m.num_layers, expert_parallel_size=max(ep, 1))
    if moe.num_experts is None:
        if ep > 1:
            out.append(f"--expert-model-parallel-size {ep} needs --num-experts (a dense model has no "
                       f"experts to split)")
        return out
    if m.transformer_impl == "transformer_engine":
        out.append("--num-experts builds megafab's own MoE layers inside the local transformer layer; "
                   "use --transformer-impl local (Transformer Engine's layer has no MoE MLP here)")
    if tp > 1 and not p.sequence_parallel:
        out.append(f"MoE layers with --tensor-model-parallel-size {tp} need --sequence-parallel (Megatron "
                   f"refuses to train MoE under TP without it)")
    if m.add_bias_linear and etp is not None and etp > 1:
        out.append(f"biases in MoE experts need --expert-tensor-parallel-size 1 (it is {etp}); add "
                   f"--disable-bias-linear or set --expert-tensor-parallel-size 1")
    # each rank holds an equal slice of every expert's (ETP) and the shared experts' (TP) width
    width, shared = moe.moe_ffn_hidden_size or m.ffn_hidden_size, moe.moe_shared_expert_intermediate_size
    for flag, value, flag_of_size, size in (
            ("--moe-ffn-hidden-size", width, "--expert-tensor-parallel-size", etp),
            ("--moe-shared-expert-intermediate-size", shared, "--tensor-model-parallel-size", tp)):
        if value and size and size >= 1 and value > 0 and value % size:
            out.append(f"{flag} {value} is not divisible by {flag_of_size} {size}; each rank holds an "
                       f"equal slice of the width")
    return out


def context_parallel_problems(cfg) -> list[str]:
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


def precision_problems(cfg) -> list[str]:
    pr, m = cfg.precision, cfg.model
    out = []
    if pr.fp16 and pr.bf16:
        out.append("--fp16 and --bf16 were both given; choose one precision")
    if pr.fp8_format is not None:
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


def training_problems(cfg) -> list[str]:
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
    out += rampup_problems(cfg)
    out += profile_problems(cfg)
    return out


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
    if kind in ("GPT2BPETokenizer",):
        for flag, value in (("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)):
            if value is None:
                out.append(f"--tokenizer-type {kind} needs {flag}")
    elif kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                  "HuggingFaceTokenizer"):
        if d.tokenizer_model is None:
            out.append(f"--tokenizer-type {kind} needs --tokenizer-model")
    elif kind == "TikTokenizer":
        if d.tokenizer_model is None:
            out.append("--tokenizer-type TikTokenizer needs --tokenizer-model (Megatron's tiktoken "
                       "vocabulary .json)")
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
    if d.reset_attention_mask and not d.create_attention_mask_in_dataloader:
        out.append("--reset-attention-mask needs the attention mask the data loader builds; drop "
                   "--no-create-attention-mask-in-dataloader (or --reset-attention-mask)")
    out += data_path_problems(cfg)
    return out


def data_path_problems(cfg) -> list[str]:
    """Each data-path flag and --split parses (megafab.data.blend_spec's rules)."""
    from megafab.data.blend_spec import parse_blend, parse_split
    from megafab.data.errors import DataError

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
    if c.save_interval and not c.save:
        out.append("--save-interval needs --save DIR")
    if c.ckpt_format not in CKPT_FORMATS:
        out.append(f"--ckpt-format {c.ckpt_format!r} is not supported by megafab (it reads and writes "
                   f"{' and '.join(CKPT_FORMATS)})")
    elif c.ckpt_format == "torch" and c.save and not c.no_save_optim:
        out.append("--ckpt-format torch (Megatron's legacy files) is written without optimizer state: its "
                   "layout follows Megatron's parameter order and buffers, which no other layout reads; add "
                   "--no-save-optim, or save --ckpt-format torch_dist (the default, fully reshardable)")
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
