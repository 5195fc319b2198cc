"""--use-checkpoint-args: the model arguments a checkpoint records override the command line's.

As Megatron-LM's load_args_from_checkpoint (megatron/training/checkpointing.py), applied to the parsed
flags before the config is derived and checked: the arguments of its list (Megatron's argument names
are megafab's field names) take the checkpoint's value -- `forced` ones always, the others only where
the command line left them None; the tokenizer's unless --no-use-tokenizer-model-from-checkpoint-args;
the parallel sizes only with --use-mp-args-from-checkpoint-args. --pretrained-checkpoint's args apply
first, --load's over them. The args are read as the loader reads them (formats.py, megatron_dist,
megatron_legacy, source.py); a checkpoint that cannot be read is one problem line, one that is not
there or records no args leaves the command line's arguments (Megatron's fallback), said in a note.
"""

from __future__ import annotations

import os

from megafab.checkpoint import formats, megatron_dist, safe_pickle
from megafab.checkpoint.directory import iteration_of_directory
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.megatron_args import flag, flat_from_args
from megafab.checkpoint.megatron_legacy import _first_file
from megafab.checkpoint.source import read_common_json

# Megatron-LM HEAD's list, in its order: (name, forced); moe_ffn_hidden_size follows moe_layer_freq
# (forced when the checkpoint has experts, else cleared). "?" marks the arguments set only when the
# command line leaves them None.
_LIST = """num_layers? hidden_size? ffn_hidden_size? seq_length? num_attention_heads? num_query_groups
    group_query_attention kv_channels? max_position_embeddings? position_embedding_type add_position_embedding
    use_rotary_position_embeddings rotary_base rotary_percent rotary_interleaved add_bias_linear add_qkv_bias
    squared_relu swiglu untie_embeddings_and_output_weights apply_layernorm_1p normalization
    apply_query_key_layer_scaling attention_dropout hidden_dropout mtp_hybrid_override_pattern mtp_num_layers
    mtp_use_repeated_layer spec num_experts moe_layer_freq moe_router_topk moe_token_dispatcher_type?
    moe_router_pre_softmax moe_grouped_gemm moe_single_grouped_weight moe_single_grouped_bias
    moe_shared_expert_intermediate_size moe_router_score_function moe_router_enable_expert_bias
    moe_router_topk_scaling_factor mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads
    gdp_num_householder hybrid_layer_pattern? heterogeneous_layers_config_path
    heterogeneous_layers_config_encoded_json moe_latent_size"""
_TOKENIZER = "tokenizer_model tokenizer_type"
_VOCAB = "tiktoken_pattern padded_vocab_size? ckpt_format?"
_MP = """tensor_model_parallel_size pipeline_model_parallel_size virtual_pipeline_model_parallel_size
    num_layers_per_virtual_pipeline_stage? expert_model_parallel_size"""
# Arguments of models megafab does not build, None unless the checkpoint's model is one of them (the
# other names megafab has no flag for -- Mamba's sizes, grouped GEMM -- Megatron records at defaults).
NOT_BUILT = ("spec", "hybrid_layer_pattern", "mtp_hybrid_override_pattern", "moe_latent_size",
             "heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json")


def _parse(names: str) -> list[tuple[str, bool]]:
    return [(n.rstrip("?"), not n.endswith("?")) for n in names.split()]


def find(load_dir: str, step: int | None) -> formats.Found | None:
    """The checkpoint --load names, as load_checkpoint finds it (a save directory, or one iter_ dir)."""
    found = formats.find_checkpoint(load_dir, step)
    named = iteration_of_directory(load_dir) if found is None else None
    if named is not None:
        found = formats.find_checkpoint(os.path.dirname(os.path.normpath(load_dir)), named)
    return found


def read_args(found: formats.Found) -> tuple[dict, float]:
    """(the checkpoint's args as plain values, {} when it records none; its checkpoint_version)."""
    if found.format == formats.MEGAFAB:
        return dict(read_common_json(found.path)["config"]), 3.0
    if found.format == formats.TORCH_DIST:
        megatron_dist.read_metadata_json(found.path)
        state = megatron_dist.read_common(found.path)
    else:
        first = _first_file(found.path)
        if first is None:
            raise CheckpointError(f"{found.path} has no model_optim_rng.pt of rank 0: the legacy checkpoint "
                                  f"is incomplete")
        state = safe_pickle.load(first, mmap=True)
    return flat_from_args(state.get("args")), float(state.get("checkpoint_version", 0) or 0)


def _names(saved: dict, version: float, tokenizer: bool, mp: bool) -> list[tuple[str, bool, str]]:
    """(argument, forced, the checkpoint's name of it) in Megatron's order."""
    names = _parse(_LIST)
    at = [n for n, _ in names].index("moe_layer_freq") + 1
    if saved.get("num_experts") is not None:
        names.insert(at, ("moe_ffn_hidden_size", True))
    names += _parse(_TOKENIZER) if tokenizer else []
    names += _parse(_VOCAB)
    out = [(n, forced, n) for n, forced in names]
    if mp and version < 3.0:
        out.append(("tensor_model_parallel_size", False, "model_parallel_size"))
    elif mp:
        out += [(n, forced, n) for n, forced in _parse(_MP)]
    return out


def apply(args, saved: dict, version: float) -> tuple[list[str], list[str]]:
    """Set the parsed flags `args` (a Namespace) from a checkpoint's `saved` args as Megatron does;
    returns ("--flag value" per argument set, "--flag value" per model megafab does not build)."""
    saved = dict(saved)
    if "disable_bias_linear" in saved:  # Megatron's one-off conversion for foundation models
        saved["add_bias_linear"] = not saved["disable_bias_linear"]
    if saved.get("hybrid_override_pattern") is not None and saved.get("hybrid_layer_pattern") is None:
        saved["hybrid_layer_pattern"], saved["num_layers"] = saved["hybrid_override_pattern"], None
    if saved.get("num_experts") is None and hasattr(args, "moe_ffn_hidden_size"):
        args.moe_ffn_hidden_size = None  # Megatron: a dense checkpoint's model has none
    names = _names(saved, version, args.use_tokenizer_model_from_checkpoint_args,
                   args.use_mp_args_from_checkpoint_args)
    applied, not_built = [], []
    for name, forced, saved_name in names:
        value = saved.get(saved_name)
        if value is None or (not forced and getattr(args, name, None) is not None):
            continue
        if not hasattr(args, name):
            if name in NOT_BUILT:
                not_built.append(f"{flag(name)} {value!r}")
            continue
        setattr(args, name, value)
        applied.append(f"{flag(name)} {value!r}")
    return applied, not_built


def use_checkpoint_args(args) -> tuple[list[str], list[str], list[str]]:
    """(notes, fallbacks, problems) of --use-checkpoint-args on the parsed flags `args`, which it
    updates; nothing without the flag. A --load without a checkpoint, or one that records no args, is
    a fallback (Megatron keeps the command line's arguments then): a note, and a line of the error
    should the command line's arguments not make a model."""
    if not args.use_checkpoint_args:
        return [], [], []
    given = (("--pretrained-checkpoint", args.pretrained_checkpoint), ("--load", args.load))
    dirs = [(which, d) for which, d in given if d]
    if not dirs:
        return [], [], ["--use-checkpoint-args: it reads the model arguments from the checkpoint in --load "
                        "(or --pretrained-checkpoint), and neither is given; pass --load DIR"]
    if args.non_persistent_ckpt_type == "local":
        return [], [], ["--use-checkpoint-args: not with --non-persistent-ckpt-type local (Megatron's rule: "
                        "the node-local checkpoints are found only after the arguments are set); load a "
                        "persistent or global checkpoint, or pass the model's flags"]
    notes, fallbacks, problems = [], [], []
    for which, load_dir in dirs:
        try:
            found = find(load_dir, args.ckpt_step if which == "--load" else None)
            saved, version = read_args(found) if found is not None else ({}, 0.0)
        except (CheckpointError, OSError) as err:
            problems.append(f"--use-checkpoint-args with {which} {load_dir}: {err}")
            continue
        if found is None or not (saved.get("num_layers") or saved.get("hidden_size")):
            why = "holds no checkpoint (latest_checkpointed_iteration.txt not found)" if found is None else \
                f"records no model arguments ({found.path}: a bare dist_checkpointing.save)"
            fallbacks.append(f"--use-checkpoint-args: {which} {load_dir} {why}, so the command line's model "
                             f"arguments stand, as in Megatron")
            continue
        applied, not_built = apply(args, saved, version)
        notes.append(f"--use-checkpoint-args: from {found.path}: " + (", ".join(applied) or "nothing to set"))
        if not_built:
            problems.append(f"--use-checkpoint-args with {which} {load_dir}: the checkpoint's model has "
                            f"{', '.join(not_built)}, which megafab does not build")
    return notes, fallbacks, problems
