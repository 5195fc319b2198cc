"""The files of a checkpoint directory, checked where they are read: each problem is one
CheckpointError naming the file, what is wrong with it and the fix (never a bare OSError,
JSONDecodeError or a DCP exception from inside a collective).

    iter_0000100/common.json        read_common
    iter_0000100/.metadata          read_dcp_metadata (through dcp_io's safe unpickler)
    iter_0000100/__<r>_0.distcp     check_storage_files: present and as long as .metadata says
    iter_0000100/rng/rank_<r>.pt    rng_file
"""

from __future__ import annotations

import json
import os
import re

from megafab.checkpoint.directory import COMMON
from megafab.checkpoint.errors import CheckpointError

ITERATION_DIR = re.compile(r"iter_(\d{7})$")
# The model fields that fix the global shape of some tensor (flag = --name with dashes).
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
                "group_query_attention", "num_query_groups", "swiglu", "untie_embeddings_and_output_weights",
                "add_bias_linear", "add_qkv_bias", "normalization", "position_embedding_type",
                "max_position_embeddings", "padded_vocab_size")
OLDER = "load an older checkpoint (write its iteration into latest_checkpointed_iteration.txt)"


def iteration_of_directory(path: str) -> int | None:
    """4 for '.../iter_0000004' (a --load that names one checkpoint, not the save directory)."""
    match = ITERATION_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def read_common(path: str) -> dict:
    file = os.path.join(path, COMMON)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} has no {COMMON}: it is not a megafab checkpoint (a Megatron-LM "
                              f"torch or torch_dist checkpoint must be converted first)")
    try:
        with open(file) as f:
            common = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e}); the checkpoint is damaged: {OLDER}") from None
    missing = [k for k in ("iteration", "consumed_train_samples", "has_optimizer", "has_rng", "layout")
               if not isinstance(common, dict) or k not in common]
    if missing:
        raise CheckpointError(f"{file}: has no {', '.join(missing)}; the checkpoint is damaged: {OLDER}")
    return common


def read_dcp_metadata(path: str, io):
    """DCP's .metadata of `path` through the dcp_io module `io` (its safe unpickler)."""
    file = os.path.join(path, ".metadata")
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing, so the tensors of {path} cannot be located; the checkpoint "
                              f"is damaged: {OLDER}")
    try:
        return io.read_metadata(path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign pickle fails in many ways
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e}); the checkpoint is damaged: "
                              f"{OLDER}") from None


def check_storage_files(path: str, metadata) -> None:
    """Every .distcp file the metadata points into exists and is long enough."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing (one rank's tensor shard); the checkpoint is damaged: "
                                  f"restore the file or {OLDER}")
        actual = os.path.getsize(file)
        if actual < size:
            raise CheckpointError(f"{file}: {actual} bytes, but .metadata places tensors up to byte {size}; "
                                  f"the shard is truncated: restore it or {OLDER}")


def rng_file(path: str, rank: int) -> str:
    file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing, so rank {rank}'s random state cannot be restored; restore "
                              f"it, or pass --no-load-rng (dropout and data-loader randomness then differ "
                              f"from an uninterrupted run)", every_rank=False)
    return file


def model_shape_differences(saved: dict, model) -> list[str]:
    """'--hidden-size: 32 in the checkpoint, 64 here' for each shape-defining field that differs."""
    out = []
    for name in SHAPE_FIELDS:
        if name in saved and saved[name] != getattr(model, name, None):
            label = "the padded vocabulary" if name == "padded_vocab_size" else f"--{name.replace('_', '-')}"
            out.append(f"{label}: {saved[name]} in the checkpoint, {getattr(model, name, None)} here")
    return out
