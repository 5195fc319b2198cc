"""The configuration's cross-field rules for the model, its layout and its precision, and the
rules the components own (asked through their `problems()` functions). Pure functions of the
values; each broken rule is one line."""

from __future__ import annotations

import dataclasses

from megafab.config.derive import CP_COMM_TYPES, scheduler_samples
from megafab.config.schema import SECTIONS
from megafab.distributed.schedule_table import interleaving_problem
from megafab.layout import layout_problems, rank_order
from megafab.pipeline_split import PipelineSplit


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
    # deferred: the components import torch; flag errors and --help stay free of it
    from megafab.data.packed_documents import document_masking_problems
    from megafab.distributed.data_parallel import bucket_size_problems
    from megafab.model.activations import activation_problems
    from megafab.model.core_attention import window_attention_problems
    from megafab.model.mtp import mtp_problems
    from megafab.model.recompute import RecomputeSettings
    from megafab.model.rotary import rope_scaling_problems
    from megafab.model.te import te_layer_problems
    from megafab.optim.cpu_offload import offload_problems
    from megafab.optim.grad_scaler import scaler_problems
    from megafab.optim.lr_scheduler import schedule_problems

    m, o, t, p, pr = cfg.model, cfg.optimizer, cfg.training, cfg.parallel, cfg.precision
    recompute = RecomputeSettings.from_model_config(m, check=False)
    out = recompute.problems() + recompute.model_problems(
        multi_latent_attention=getattr(m, "multi_latent_attention", False), moe=cfg.moe)
    out += te_layer_problems(m)
    out += mtp_problems(m, p)
    out += rope_scaling_problems(m)
    out += activation_problems(m)
    out += window_attention_problems(m, p)
    out += document_masking_problems(cfg)
    if o.optimizer_offload_fraction is not None:
        out += offload_problems(o.optimizer_offload_fraction)
    if p.ddp_bucket_size is not None and not p.fully_sharded:
        out += bucket_size_problems(p.ddp_bucket_size)
    if pr.fp16 or pr.loss_scale is not None:  # the scaler training builds for fp16
        out += scaler_problems(loss_scale=pr.loss_scale, initial_scale=pr.initial_loss_scale,
                               min_scale=pr.min_loss_scale, growth_interval=pr.loss_scale_window,
                               hysteresis=pr.hysteresis)
    if o.lr is not None:  # without a global batch size (a broken layout) the lengths are unknown
        lengths = scheduler_samples(o, t) if t.global_batch_size else {
            "lr_decay_samples": None, "wsd_decay_samples": o.lr_wsd_decay_samples or o.lr_wsd_decay_iters}
        out += schedule_problems(max_lr=o.lr, min_lr=o.min_lr, lr_decay_style=o.lr_decay_style,
                                 lr_wsd_decay_style=o.lr_wsd_decay_style, **lengths)
    return out


def required(cfg_section, names: list[str]) -> list[str]:
    return [f"--{n.replace('_', '-')} is required" for n in names if getattr(cfg_section, n) is None]


def model_problems(cfg) -> list[str]:
    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    out = required(m, ["num_layers", "hidden_size", "num_attention_heads", "seq_length"])
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
    ffn = m.ffn_hidden_size
    # experts: moe_problems; heads that TP cannot split are the one mistake (a derived width follows)
    if ffn and cfg.moe.num_experts is None and tp >= 1 and ffn % tp and not (heads and heads % tp):
        out.append(f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {tp}; each "
                   f"TP rank holds an equal slice of the MLP: pick a TP size that divides {ffn}")
    if m.seq_length and m.max_position_embeddings and m.seq_length > m.max_position_embeddings:
        out.append(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                   f"{m.max_position_embeddings}; raise --max-position-embeddings or shorten sequences")
    if not 0.0 < m.rotary_percent <= 1.0:
        out.append(f"--rotary-percent {m.rotary_percent} must be in (0, 1]")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(m, name) < 1.0:
            out.append(f"--{name.replace('_', '-')} {getattr(m, name)} must be in [0, 1)")
    activations = [f for f, on in (("--swiglu", m.swiglu), ("--quick-geglu", m.quick_geglu),
                                   ("--squared-relu", m.squared_relu), ("--openai-gelu", m.openai_gelu))
                   if on]
    if len(activations) > 1:
        out.append(f"{' and '.join(activations)} each choose the MLP activation; give one of them")
    return out + padded_vocab_problems(cfg) + mla_problems(cfg)


def padded_vocab_problems(cfg) -> list[str]:
    """A given --padded-vocab-size (a derived one always fits): every token id has a row, and TP
    splits the rows evenly."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    padded, out = m.padded_vocab_size, []
    if padded is None:
        return out
    if m.vocab_size and padded < m.vocab_size:
        out.append(f"--padded-vocab-size {padded} is smaller than the vocabulary size {m.vocab_size}; "
                   f"give at least {m.vocab_size}, or leave it out to derive it")
    if tp >= 1 and padded % tp:
        out.append(f"--padded-vocab-size {padded} is not divisible by --tensor-model-parallel-size {tp}; "
                   f"each TP rank holds an equal slice of the vocabulary: give a multiple of {tp}")
    return out


def mla_problems(cfg) -> list[str]:
    """Multi-latent attention's and YaRN's rules (model/mla.py, model/rotary.py)."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    out = []
    yarn = m.position_embedding_type == "yarn" or (m.multi_latent_attention and m.rope_type != "rope")
    if m.multi_latent_attention and m.rotary_interleaved:  # megatron-core's TransformerConfig refuses it
        out.append("--rotary-interleaved does not work with --multi-latent-attention (megatron-core's rule: "
                   "MLA pairs its RoPE channels itself); drop --rotary-interleaved")
    if m.rope_type == "yarn" and not m.multi_latent_attention:
        out.append("--rope-type yarn is for --multi-latent-attention (Megatron: standard attention takes "
                   "rope only); give standard attention YaRN with --position-embedding-type yarn")
    if yarn and m.rotary_percent != 1.0:
        out.append(f"--rotary-percent {m.rotary_percent} with YaRN: megatron-core's YaRN rotates every "
                   f"channel of the RoPE part; drop --rotary-percent or use plain RoPE")
    if yarn and not m.rotary_scaling_factor > 0:
        out.append(f"--rotary-scaling-factor {m.rotary_scaling_factor} must be positive (1: no scaling)")
    for flag, value in (("--yarn-original-max-position-embeddings", m.yarn_original_max_position_embeddings),
                        ("--yarn-beta-fast", m.yarn_beta_fast), ("--yarn-beta-slow", m.yarn_beta_slow)):
        if yarn and value is not None and not value > 0:
            out.append(f"{flag} {value} must be positive")
    if not m.multi_latent_attention:
        return out
    if m.position_embedding_type == "yarn":
        out.append("--position-embedding-type yarn with --multi-latent-attention: MLA applies its own RoPE "
                   "to its RoPE part; use --position-embedding-type rope and --rope-type yarn")
    if m.group_query_attention:
        out.append("--multi-latent-attention and --group-query-attention exclude each other (MLA's keys and "
                   "values come from one latent per token); drop --group-query-attention")
    if m.add_qkv_bias:
        out.append("--add-qkv-bias with --multi-latent-attention: MLA's projections have no bias "
                   "(megatron-core's); drop --add-qkv-bias")
    sizes = (("--kv-lora-rank", m.kv_lora_rank), ("--qk-head-dim", m.qk_head_dim),
             ("--qk-pos-emb-head-dim", m.qk_pos_emb_head_dim), ("--v-head-dim", m.v_head_dim),
             ("--q-lora-rank", m.q_lora_rank))
    bad = [f"{flag} {value}" for flag, value in sizes if value is not None and value <= 0]
    if bad:
        return out + [f"{', '.join(bad)}: MLA's ranks and head widths must be positive"]
    rotated = m.qk_pos_emb_head_dim if yarn else int(m.qk_pos_emb_head_dim * m.rotary_percent)
    if rotated % 2:
        out.append(f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim}: RoPE rotates channel pairs, so its "
                   f"rotated part ({rotated} channels) must be even")
    # the down projections are column-parallel (the local spec's): whole slices per TP rank
    for flag, width in (("--q-lora-rank", m.q_lora_rank),
                        ("--kv-lora-rank + --qk-pos-emb-head-dim", m.kv_lora_rank + m.qk_pos_emb_head_dim)):
        if width is not None and tp >= 1 and width % tp:
            out.append(f"{flag} = {width} is not divisible by --tensor-model-parallel-size {tp}; MLA's down "
                       f"projections are column-parallel: pick sizes TP divides")
    return out


def parallel_problems(cfg) -> list[str]:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, pp, world = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.world_size
    cp = p.context_parallel_size
    # without a known world (world None) only the sizes themselves are checked
    out = layout_problems(world, tp, pp, cp, p.expert_model_parallel_size, p.expert_tensor_parallel_size,
                          rank_order(p.use_tp_pp_dp_mapping))
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
    group = p.microbatch_group_size_per_vp_stage
    if interleaved and vpp and t.num_micro_batches and pp > 1 and group is None and t.num_micro_batches % pp:
        out.append(f"the interleaved schedule needs the number of micro-batches "
                   f"({t.num_micro_batches} = global batch / (micro batch x dp)) to be a multiple of "
                   f"--pipeline-model-parallel-size {pp}")
    elif interleaved and vpp and t.num_micro_batches and pp > 1 and group is not None:
        problem = interleaving_problem(t.num_micro_batches, pp, group)
        if problem:
            out.append(f"--microbatch-group-size-per-virtual-pipeline-stage: {problem}")
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
    if tp > 1 and not p.sequence_parallel:
        out.append(f"MoE layers with --tensor-model-parallel-size {tp} need --sequence-parallel (Megatron "
                   f"refuses to train MoE under TP without it)")
    if m.add_bias_linear and etp is not None and etp > 1:
        out.append(f"biases in MoE experts need --expert-tensor-parallel-size 1 (it is {etp}); add "
                   f"--disable-bias-linear or set --expert-tensor-parallel-size 1")
    if m.add_bias_linear and moe.moe_shared_expert_intermediate_size:
        out.append("--moe-shared-expert-intermediate-size with biased linear layers (--add-bias-linear, "
                   "Megatron's default): megatron-core's shared experts have no bias and refuse it; add "
                   "--disable-bias-linear")
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
    if m.transformer_impl == "transformer_engine" and (cfg.data.reset_attention_mask
                                                       or cfg.data.dataloader_inter_document_masking):
        out.append("--transformer-impl transformer_engine with --context-parallel-size > 1 runs Transformer "
                   "Engine's CP attention, which takes no per-document mask; use --transformer-impl local "
                   "with document masks under CP")
    if cfg.data.reset_attention_mask and not cfg.data.dataloader_inter_document_masking:
        out.append("--reset-attention-mask with --context-parallel-size > 1: CP attention is causal "
                   "over the whole sequence and takes no per-sample mask; drop --reset-attention-mask "
                   "or use --context-parallel-size 1")
    return out


def precision_problems(cfg) -> list[str]:
    pr, m = cfg.precision, cfg.model
    out = []
    if pr.fp16 and pr.bf16:
        out.append("--fp16 and --bf16 were both given; choose one precision")
    if pr.fp8_format is not None and m.transformer_impl != "transformer_engine":
        out.append("--fp8-format needs --transformer-impl transformer_engine (FP8 runs in "
                   "Transformer Engine's layers)")
    if pr.fp8_param_gather:
        out += fp8_param_gather_problems(cfg)
    if cfg.parallel.grad_reduce_in_bf16 and not pr.bf16:
        out.append("--grad-reduce-in-bf16 needs --bf16 (gradients of fp32/fp16 models are reduced in "
                   "fp32); add --bf16 or drop --grad-reduce-in-bf16")
    return out


def fp8_param_gather_problems(cfg) -> list[str]:
    """--fp8-param-gather: TE's FP8 weights under the distributed optimizer or FSDP2
    (model/fp8_params.py)."""
    pr, p = cfg.precision, cfg.parallel
    if pr.fp8_format is None:
        return ["--fp8-param-gather needs --fp8-format (the FP8 weights are Transformer Engine's, "
                "--transformer-impl transformer_engine); add --fp8-format hybrid, or drop --fp8-param-gather"]
    out = []
    if not (p.use_distributed_optimizer or p.fully_sharded):
        out.append("--fp8-param-gather needs --use-distributed-optimizer or FSDP2 (as Megatron: their fp32 "
                   "main shards are cast into the FP8 weights); add --use-distributed-optimizer")
    if pr.fp8_recipe in ("mxfp8", "blockwise"):
        out.append(f"--fp8-param-gather with --fp8-recipe {pr.fp8_recipe} is not implemented (TE's "
                   f"replace_raw_data and cast_master_weights_to_fp8 cover per-tensor scaling); use "
                   f"--fp8-recipe delayed or tensorwise")
    if cfg.optimizer.optimizer_cpu_offload:
        out.append("--fp8-param-gather with --optimizer-cpu-offload is not implemented (the host optimizer "
                   "writes weights by copy, not TE's FP8 cast); drop one of them")
    return out
