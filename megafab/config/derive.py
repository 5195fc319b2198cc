"""Megatron's derivations: the values a run computes from the flags (megatron/training/arguments.py).

Pure arithmetic on config values, shared by training (Config.finalize), conversion
(megafab/convert) and the LR scheduler's rules: micro-batches, padded vocabulary, FFN width,
virtual pipeline size, Megatron-FSDP's strategy, gradient buckets, the schedule in samples. The
grid's sizes (DP, ETP's default) are megafab.layout's, read from there.
"""

from __future__ import annotations

from megafab.config.batch_schedule import final_scheduled_batch, schedule_note
from megafab.layout import data_parallel_size, expert_tensor_parallel_size

# --cp-comm-type spellings -> the name megafab uses (Megatron says allgather).
CP_COMM_TYPES = {"p2p": "p2p", "allgather": "allgather", "all_gather": "allgather", "a2a": "a2a"}

MEGATRON_FSDP_ENGINES = {"no_shard": "ZeRO-0: replicated data parallelism",
                         "optim": "ZeRO-1: the distributed optimizer",
                         "optim_grads": "ZeRO-2's communication: torch FSDP2 keeping the gathered weights "
                                        "from forward to backward",
                         "optim_grads_params": "ZeRO-3: torch FSDP2"}


def swiglu_ffn_size(hidden_size: int) -> int:
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def default_bucket_size(dp: int) -> int:
    return max(40_000_000, 1_000_000 * dp)


# --enable-gpt-oss: the values Megatron-LM HEAD's ModelOpt model builder sets on the config
GPT_OSS_YARN = {"position_embedding_type": "yarn", "rotary_scaling_factor": 32.0,
                "yarn_original_max_position_embeddings": 131072, "yarn_beta_fast": 32.0,
                "yarn_beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                "yarn_correction_range_round_to_int": False}


def derive_model(m, tp: int) -> None:
    """Fill the model's derived sizes that are unset, in place (`m` is not yet frozen)."""
    if m.enable_gpt_oss:
        for name, value in GPT_OSS_YARN.items():
            setattr(m, name, value)
    if m.hidden_size and m.ffn_hidden_size is None:
        m.ffn_hidden_size = swiglu_ffn_size(m.hidden_size) if m.swiglu else 4 * m.hidden_size
    if m.hidden_size and m.num_attention_heads and m.kv_channels is None \
            and m.hidden_size % m.num_attention_heads == 0:
        m.kv_channels = m.hidden_size // m.num_attention_heads
    if not m.group_query_attention:
        m.num_query_groups = m.num_attention_heads
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.vocab_size and tp >= 1 and m.padded_vocab_size is None:
        m.padded_vocab_size = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)


def derive_moe(moe, m) -> None:
    """Megatron's MoE derivations: one-value lists become the value (its validate_args), several a
    tuple; the experts' width defaults to --ffn-hidden-size."""
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(moe, name)
        if isinstance(value, (list, tuple)):
            setattr(moe, name, value[0] if len(value) == 1 else tuple(value))
    if isinstance(moe.moe_layer_freq, list):
        moe.moe_layer_freq = tuple(moe.moe_layer_freq)
    if moe.num_experts == 0:  # Megatron: 0 experts means a dense model
        moe.num_experts = None
    if moe.moe_expert_capacity_factor is not None and moe.moe_expert_capacity_factor < 0:
        moe.moe_expert_capacity_factor = None  # Megatron: a negative factor means no capacity
    if moe.num_experts is not None and moe.moe_ffn_hidden_size is None:
        moe.moe_ffn_hidden_size = m.ffn_hidden_size


def virtual_pipeline_size(m, p) -> int | None:
    """Model chunks per pipeline rank (vpp), None without interleaving or when the layers do not split."""
    pp = p.pipeline_model_parallel_size
    if p.num_virtual_stages_per_pipeline_rank is not None:
        return p.num_virtual_stages_per_pipeline_rank
    if p.num_layers_per_virtual_pipeline_stage and m.num_layers and pp >= 1:
        # Megatron counts the embedding/loss "layers" here too
        split_layers = m.num_layers + p.account_for_embedding_in_pipeline_split \
            + p.account_for_loss_in_pipeline_split
        if split_layers % (pp * p.num_layers_per_virtual_pipeline_stage) == 0:
            return split_layers // pp // p.num_layers_per_virtual_pipeline_stage
    return None


def megatron_fsdp_grad_dtype(p) -> str:
    """The dtype Megatron-FSDP's gradients are reduced in: --megatron-fsdp-grad-comm-dtype, else
    --megatron-fsdp-main-grads-dtype ("auto": megafab's --grad-reduce-in-bf16 rule)."""
    comm = p.megatron_fsdp_grad_comm_dtype
    return comm if comm != "auto" else p.megatron_fsdp_main_grads_dtype


def fsdp_main_params_in_model_dtype(p) -> bool:
    """--megatron-fsdp-main-params-dtype other than fp32 (auto, or the 16-bit model's own dtype, the
    only other one megafab takes): the optimizer steps FSDP2's 16-bit shards, no fp32 master copy."""
    return p.use_megatron_fsdp and p.megatron_fsdp_main_params_dtype != "fp32"


def resolve_sharding(cfg) -> None:
    """Derive `fully_sharded` and the offload fraction; map Megatron-FSDP's strategies onto
    megafab's engines (with a note saying what runs)."""
    p, o = cfg.parallel, cfg.optimizer
    if o.optimizer_cpu_offload and o.optimizer_offload_fraction is None:
        o.optimizer_offload_fraction = 1.0
    p.fully_sharded = p.use_torch_fsdp2
    if not p.use_megatron_fsdp or p.use_torch_fsdp2:
        return
    strategy = p.data_parallel_sharding_strategy or "optim_grads_params"
    if strategy not in MEGATRON_FSDP_ENGINES:
        return  # refused by the rules
    p.data_parallel_sharding_strategy = strategy
    asked_dist_opt = p.use_distributed_optimizer
    p.use_distributed_optimizer = strategy == "optim"
    p.fully_sharded = strategy in ("optim_grads", "optim_grads_params")
    note = (f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy} runs as "
            f"{MEGATRON_FSDP_ENGINES[strategy]}")
    if asked_dist_opt and strategy != "optim":
        note += " (--use-distributed-optimizer, which Megatron-FSDP requires, shards nothing more here)"
    cfg.notes.append(note)


def derive(cfg, world_size: int) -> None:
    """Fill every derived value of `cfg` (not yet frozen) as Megatron does."""
    m, p, t, o, d = cfg.model, cfg.parallel, cfg.training, cfg.optimizer, cfg.data
    p.world_size = world_size
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    p.data_parallel_size = data_parallel_size(world_size, tp, cp, pp)
    p.cp_comm_type = CP_COMM_TYPES.get(p.cp_comm_type, p.cp_comm_type)
    given_positions = m.position_embedding_type
    derive_model(m, tp)
    if m.enable_gpt_oss:
        cfg.notes.append(f"--enable-gpt-oss: gpt-oss's YaRN (factor 32, original context 131072) replaces "
                         f"--position-embedding-type {given_positions}, as Megatron's ModelOpt model builder "
                         f"does (Megatron's pretrain_gpt.py applies it only to a ModelOpt model: a ModelOpt "
                         f"checkpoint in --load, or distillation)")
    derive_moe(cfg.moe, m)
    p.expert_tensor_parallel_size = expert_tensor_parallel_size(tp, p.expert_tensor_parallel_size)
    p.virtual_pipeline_model_parallel_size = virtual_pipeline_size(m, p)
    if p.sequence_parallel and tp == 1:
        p.sequence_parallel = False
        cfg.notes.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1; "
                         "turned it off (as Megatron does)")
    if note := cfg.moe.sinkhorn_layout_note(tp, p.sequence_parallel, cp):
        cfg.notes.append(note)
    dp = p.data_parallel_size
    if t.global_batch_size is None and t.micro_batch_size and dp:
        t.global_batch_size = t.micro_batch_size * dp
    per_step = (t.micro_batch_size or 0) * (dp or 0)
    steady = final_scheduled_batch(t.step_batch_size_schedule, m.seq_length) or t.global_batch_size
    if steady and per_step and steady % per_step == 0:  # (a schedule's: its last batch, Megatron's too)
        t.num_micro_batches = steady // per_step
    if note := schedule_note(t.step_batch_size_schedule, m.seq_length, per_step):
        cfg.notes.append(note)
    if t.eval_global_batch_size is None:  # Megatron HEAD's validate_args
        t.eval_global_batch_size = t.global_batch_size
    if t.eval_micro_batch_size is None:
        t.eval_micro_batch_size = t.micro_batch_size
    if o.lr_decay_iters is None and o.lr_decay_samples is None:
        o.lr_decay_iters, o.lr_decay_samples = t.train_iters, t.train_samples
    if d.tokenizer_type is None and d.vocab_file and d.merge_file:
        d.tokenizer_type = "GPT2BPETokenizer"
        cfg.notes.append("--vocab-file and --merge-file without --tokenizer-type: using "
                         "GPT2BPETokenizer (as Megatron-LM's GPT-3 example scripts assume)")
    if p.grad_reduce_in_bf16:  # Megatron's rule: the grad buffer takes the (bf16) param dtype
        p.accumulate_allreduce_grads_in_fp32 = False
    if p.use_megatron_fsdp and megatron_fsdp_grad_dtype(p) in ("bf16", "fp16"):  # the 16-bit grad reduce
        p.accumulate_allreduce_grads_in_fp32 = False
    resolve_sharding(cfg)
    if cfg.moe.moe_layer_recompute and m.recompute_granularity != "full":  # (full: a problem, recompute.py)
        m.recompute_granularity = "selective"  # megatron-core's TransformerConfig, deprecated flag and all
        modules = list(m.recompute_modules or ["core_attn"])
        m.recompute_modules = modules + (["moe"] if "moe" not in modules else [])
        cfg.notes.append(f"--moe-layer-recompute is deprecated (Megatron): it is --recompute-granularity "
                         f"selective --recompute-modules {' '.join(m.recompute_modules)}")
    ck = cfg.checkpoint
    if ck.save_interval and not ck.save:
        cfg.notes.append(f"--save-interval {ck.save_interval} without --save: nothing is saved (as in "
                         f"Megatron); add --save DIR to keep checkpoints")
    if ck.async_save and ck.ckpt_format != "torch" and not ck.use_persistent_ckpt_worker:
        ck.async_save = False  # Megatron's validate_args, word for word in effect
        cfg.notes.append("--async-save is not supported without --use-persistent-ckpt-worker (Megatron's "
                         "rule); disabling --async-save: checkpoints are saved synchronously")
    if p.ddp_bucket_size is None and dp and not p.fully_sharded:
        p.ddp_bucket_size = default_bucket_size(dp)


def scheduler_samples(o, t) -> dict:
    """The LR schedule's lengths in samples (Megatron counts it in samples; iteration flags are
    converted with the global batch size): decay, warmup and WSD's final decay."""
    gbs = t.global_batch_size or 0
    decay = o.lr_decay_samples or (o.lr_decay_iters or t.train_iters or 1) * gbs
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay  # Megatron's, a float
    else:
        warmup = o.lr_warmup_samples or o.lr_warmup_iters * gbs
    wsd = o.lr_wsd_decay_samples or (o.lr_wsd_decay_iters * gbs if o.lr_wsd_decay_iters else None)
    return {"lr_decay_samples": decay, "lr_warmup_samples": warmup, "wsd_decay_samples": wsd}
