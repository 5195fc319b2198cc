"""The `args` a Megatron-LM checkpoint records, and what megafab checks and writes in it.

Megatron saves its argparse.Namespace in every checkpoint (common.pt, model_optim_rng.pt); megafab's
config fields carry Megatron's argument names, so the Namespace megafab writes is its flat config
plus the derived names Megatron's loader reads (padded_vocab_size, add_position_embedding,
consumed_train_samples, ...). On load, every argument that shapes the model's function is compared
with this run's flags; each mismatch is one line of one error (Megatron's check_checkpoint_args
asserts on the first). Megatron options megafab does not implement are refused when the
checkpoint was trained with them; once megafab's ModelConfig has the field, it is compared instead.
"""

from __future__ import annotations

import argparse
import types

from megafab.checkpoint.errors import CheckpointError
from megafab.config.derive import GPT_OSS_YARN

# ModelConfig fields that define the model's weights or its function.
MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "position_embedding_type", "rotary_percent", "rotary_base",
              "max_position_embeddings", "normalization", "norm_epsilon", "swiglu", "openai_gelu",
              "squared_relu", "quick_geglu", "activation_func_clamp_value", "glu_linear_offset",
              "apply_layernorm_1p", "qk_layernorm",
              "window_size", "window_attn_skip_freq", "softmax_type",
              "apply_residual_connection_post_layernorm", "add_bias_linear", "add_qkv_bias",
              "untie_embeddings_and_output_weights")
# Megatron model options megafab does not implement (once ModelConfig has the field, it is compared).
MEGATRON_ONLY_ARGS = ("qk_l2_norm", "multi_latent_attention", "mtp_num_layers",
                      "rotary_interleaved", "use_rope_scaling", "rope_scaling_factor",
                      "rotary_seq_len_interpolation_factor")

# Multi-latent attention's shapes and RoPE (compared when either model is an MLA model; Megatron
# records their defaults in every checkpoint)
MLA_ARGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
            "rotary_scaling_factor", "mscale", "mscale_all_dim")

# cfg.moe fields that define a mixture-of-experts model's weights or routing (compared when the
# checkpoint records them; the rest only when both models have experts).
MOE_ARGS = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
            "moe_shared_expert_gate", "moe_router_enable_expert_bias", "moe_router_topk",
            "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
            "moe_router_num_groups", "moe_router_group_topk")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _effective(name: str, args) -> object:
    """The value an argument has after Megatron's validate_args derived it (megafab's ModelConfig
    or a checkpoint's args alike)."""
    value = getattr(args, name, None)
    if name in GPT_OSS_YARN and getattr(args, "enable_gpt_oss", False):  # Megatron's args keep the flags'
        return GPT_OSS_YARN[name]  # values; its ModelOpt builder sets these on the model's config
    if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
        return getattr(args, "num_attention_heads", None)
    if name == "add_qkv_bias":  # --add-bias-linear biases qkv too (Megatron sets add_qkv_bias then)
        return bool(value or getattr(args, "add_bias_linear", False))
    if name in ("window_size", "window_attn_skip_freq") and isinstance(value, list):
        return tuple(value)  # a tuple in the run's config, a list once stored as plain values
    if name == "position_embedding_type" and value is None:
        return "learned_absolute"
    if name == "rope_type" and value is None:  # megatron-core's MLA default
        return "yarn"
    return value


def _moe_value(name: str, values, ffn_hidden_size) -> object:
    value = getattr(values, name, None)
    if name == "moe_ffn_hidden_size" and value is None:  # Megatron's validate_args: ffn_hidden_size
        return ffn_hidden_size
    return list(value) if isinstance(value, (list, tuple)) else value


def _moe_mismatches(args, model_cfg, moe) -> list[str]:
    if not hasattr(args, "num_experts"):
        return []
    saved_experts, here_experts = args.num_experts, getattr(moe, "num_experts", None)
    if saved_experts != here_experts:
        kind = {True: "a mixture-of-experts model", False: "a dense model"}
        return [f"--num-experts: checkpoint {saved_experts!r} ({kind[bool(saved_experts)]}), this run "
                f"{here_experts!r} ({kind[bool(here_experts)]})"]
    if saved_experts is None:
        return []
    lines = []
    for name in MOE_ARGS[1:]:
        if not hasattr(args, name):
            continue
        saved = _moe_value(name, args, getattr(args, "ffn_hidden_size", None))
        here = _moe_value(name, moe, model_cfg.ffn_hidden_size)
        if saved != here:
            lines.append(f"{flag(name)}: checkpoint {saved!r}, this run {here!r}")
    return lines


def model_arg_mismatches(args, model_cfg, moe=None) -> list[str]:
    """One line per model argument the checkpoint's `args` (Namespace or dict) has otherwise than
    this run's ModelConfig (and MoE section `moe`, cfg.moe; None: a dense model); arguments the
    checkpoint does not record are not compared."""
    args = argparse.Namespace(**args) if isinstance(args, dict) else args
    lines = _moe_mismatches(args, model_cfg, moe)
    mla = getattr(args, "multi_latent_attention", False) or model_cfg.multi_latent_attention
    for name in MODEL_ARGS + (MLA_ARGS if mla else ()):
        if not hasattr(args, name):
            continue
        if name == "max_position_embeddings" and model_cfg.position_embedding_type != "learned_absolute":
            continue  # only learned positions store a table of this size
        saved, here = _effective(name, args), _effective(name, model_cfg)
        if saved != here and not (isinstance(saved, float) and isinstance(here, float) and
                                  abs(saved - here) <= 1e-12 * max(abs(here), 1.0)):
            lines.append(f"{flag(name)}: checkpoint {saved!r}, this run {here!r}")
    for name in MEGATRON_ONLY_ARGS:
        saved = getattr(args, name, None)
        if hasattr(model_cfg, name):
            if hasattr(args, name) and saved != getattr(model_cfg, name):
                lines.append(f"{flag(name)}: checkpoint {saved!r}, this run {getattr(model_cfg, name)!r}")
        elif saved not in (None, False, 0):
            lines.append(f"{flag(name)}: the checkpoint was trained with {saved!r}, which megafab does not "
                         f"implement")
    return lines


def check_model_args(args, model_cfg, path: str, moe=None) -> None:
    lines = model_arg_mismatches(args, model_cfg, moe)
    if lines:
        raise CheckpointError(
            f"{path} was saved from a different model than this run builds:\n  " + "\n  ".join(lines)
            + "\npass the checkpoint's values for these flags (the weights only load into the model "
              "they were trained as)")


def unknown_model(path: str) -> CheckpointError:
    return CheckpointError(f"{path} records no args (a bare dist_checkpointing.save), so its model "
                           f"configuration is unknown; load it into a model built from flags with --load ... "
                           f"--finetune (then save) instead of converting it alone")


def megatron_namespace(cfg, record, ckpt_format: str) -> argparse.Namespace:
    """The args a Megatron-LM checkpoint of this run records (plain values only); its counters and
    what it holds are the CommonRecord's."""
    flat = cfg.to_flat()
    m = cfg.model
    counters = record.counters
    flat.update(
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=m.position_embedding_type == "rope",
        iteration=record.iteration,
        consumed_train_samples=counters.consumed_train_samples if counters else 0,
        consumed_valid_samples=counters.consumed_valid_samples if counters else 0,
        ckpt_format=ckpt_format, use_dist_ckpt=ckpt_format == "torch_dist",
        no_save_optim=not record.has_optimizer, no_save_rng=not record.has_rng, use_mcore_models=True,
        transformer_impl=m.transformer_impl, rank=0)
    # argparse gives Megatron lists where megafab's frozen config holds tuples (--moe-layer-freq)
    return argparse.Namespace(**{k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()
                                 if _plain(v)})


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str))


def flat_from_args(args) -> dict:
    """A checkpoint's args (a Namespace; {} for anything else) as a flat dict of its plain values,
    keyed by Megatron argument name = megafab config field name."""
    values = vars(args) if isinstance(args, (argparse.Namespace, types.SimpleNamespace)) else {}
    return {k: v for k, v in values.items() if _plain(v)}
