"""The seam between a full megafab state dict (+ Config) and a megafab checkpoint directory.

The format is megafab.checkpoint's (layout.py: `model.<name>` under global shapes, SwiGLU fc1 as
a [2, f, h] view; directory.py: Megatron's `latest_checkpointed_iteration.txt` + `iter_NNNNNNN/`,
the flat config in common.json). A checkpoint saved with any TP/PP/DP layout reads back as full
tensors; a written one loads into any layout with `--finetune`. Runs in one process, without a
process group.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megafab.checkpoint import dcp_io, files, layout
from megafab.checkpoint.dcp_io import load_shards, save_shards
from megafab.checkpoint.directory import (
    COMMON,
    FORMAT_VERSION,
    TRACKER,
    commit_checkpoint,
    iteration_dir,
    latest_iteration,
    write_json,
)
from megafab.config import Config
from megafab.convert.state_dict import WORD_EMBEDDING, ConversionError, finalize_model_config


def checkpoint_path(load_dir: str, iteration: int | None = None) -> str:
    iteration = latest_iteration(load_dir) if iteration is None else iteration
    if iteration is None:
        raise ConversionError(f"{load_dir} holds no megafab checkpoint ({TRACKER} not found); pass the "
                              f"directory given to --save")
    path = iteration_dir(load_dir, iteration)
    if not os.path.isdir(path):
        raise ConversionError(f"{path} does not exist; pass an iteration that was saved")
    return path


def read_checkpoint(load_dir: str, iteration: int | None = None) -> tuple[dict[str, torch.Tensor], Config]:
    """The full megafab state dict and the training Config of a checkpoint (latest by default)."""
    path = checkpoint_path(load_dir, iteration)
    cfg = Config.from_flat(files.read_common(path).get("config", {}))
    cfg.model = finalize_model_config({k: v for k, v in vars(cfg.model).items()},
                                      cfg.parallel.tensor_model_parallel_size)
    metadata = files.read_dcp_metadata(path, dcp_io)
    files.check_storage_files(path, metadata)
    shards = {key: layout.Shard.whole(torch.empty(tuple(md.size), dtype=md.properties.dtype))
              for key, md in metadata.state_dict_metadata.items()
              if key.startswith(layout.MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}
    load_shards(shards, path)
    sd = {}
    for key, shard in shards.items():
        name, _ = layout.split_key(key)
        sd[name] = layout.from_stored(name, shard.views[0], cfg.model)
    if WORD_EMBEDDING in sd:
        cfg.model.padded_vocab_size = sd[WORD_EMBEDDING].shape[0]
    return sd, cfg


def write_checkpoint(save_dir: str, sd: dict[str, torch.Tensor], cfg: Config, iteration: int = 0) -> str:
    """Write `sd` (full megafab state dict) as a weights-only checkpoint of iteration `iteration`
    (load it with --finetune: it holds no optimizer, scheduler or RNG state)."""
    final = iteration_dir(save_dir, iteration)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_shards({layout.model_key(name): layout.Shard.whole(layout.to_stored(name, t.contiguous(), cfg.model))
                 for name, t in sd.items()}, tmp)
    common = {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_train_samples": 0,
              "skipped_iterations": 0, "nan_iterations": 0, "scheduler": None, "optimizer_iteration": 0,
              "grad_scaler": None, "has_optimizer": False, "has_rng": False,
              "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "vpp": 1}, "config": cfg.to_flat()}
    write_json(os.path.join(tmp, COMMON), common)
    commit_checkpoint(save_dir, iteration)  # the training saver's rename + tracker, same guarantees
    return final
