"""The seam between a full megafab state dict (+ Config) and a megafab checkpoint directory.

Reads and writes the format of megafab.training.checkpointing (DCP tensors `model.<name>` under
their global shapes, SwiGLU fc1 as a [2, f, h] view, the flat config in common.json, Megatron's
`latest_checkpointed_iteration.txt` + `iter_NNNNNNN/`). A checkpoint saved with any TP/PP/DP
layout reads back as full tensors; a written one loads into any layout with `--finetune`.
Runs in one process, without a process group.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megafab.config import Config
from megafab.convert.state_dict import WORD_EMBEDDING, ConversionError, finalize_model_config
from megafab.training import checkpoint_files, checkpoint_io
from megafab.training.checkpoint_io import SafeFileSystemReader
from megafab.training.checkpointing import (
    COMMON,
    FORMAT_VERSION,
    TRACKER,
    commit_checkpoint,
    iteration_dir,
    latest_iteration,
)

MODEL_PREFIX = "model."


def _is_strided(name: str, cfg: Config) -> bool:
    """Parameters with partition_stride 2 (stored with the stride blocks on a leading axis)."""
    return cfg.model.swiglu and ".mlp.linear_fc1." in name


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
    cfg = Config.from_flat(checkpoint_files.read_common(path).get("config", {}))
    cfg.model = finalize_model_config({k: v for k, v in vars(cfg.model).items()},
                                      cfg.parallel.tensor_model_parallel_size)
    metadata = checkpoint_files.read_dcp_metadata(path, checkpoint_io)
    checkpoint_files.check_storage_files(path, metadata)
    stored = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata):
            stored[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(stored, storage_reader=SafeFileSystemReader(path), no_dist=True)
    sd = {}
    for key, tensor in stored.items():
        name = key[len(MODEL_PREFIX):]
        sd[name] = tensor.flatten(0, 1) if _is_strided(name, cfg) else tensor  # [2, f, h] -> [2f, h]
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
    stored = {}
    for name, tensor in sd.items():
        tensor = tensor.contiguous()
        stored[MODEL_PREFIX + name] = tensor.unflatten(0, (2, -1)) if _is_strided(name, cfg) else tensor
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(stored, storage_writer=FileSystemWriter(tmp, thread_count=1), no_dist=True)
    common = {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_train_samples": 0,
              "skipped_iterations": 0, "nan_iterations": 0, "scheduler": None, "optimizer_iteration": 0,
              "grad_scaler": None, "has_optimizer": False, "has_rng": False,
              "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "vpp": 1}, "config": cfg.to_flat()}
    with open(os.path.join(tmp, COMMON), "w") as f:
        json.dump(common, f, indent=1, default=str)
    commit_checkpoint(save_dir, iteration)  # the training saver's rename + tracker, same guarantees
    return final
