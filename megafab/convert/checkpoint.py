"""The seam between a full megafab state dict (+ Config) and checkpoint directories of every format.

    target_config(cfg, tp, pp, ep)
                            the Config a converted checkpoint records; every rule its layout breaks
                            (megafab.checks) is one ConversionError, before anything is read or written
    read_checkpoint(DIR)    any checkpoint --load reads (Megatron torch_dist, fsdp_dtensor, legacy torch,
                            megafab's earlier format; saved with any TP/PP/DP) -> (full state dict,
                            the Config it records)
    write_checkpoint(DIR, sd, cfg, ckpt_format, tp, pp)
                            a weights-only checkpoint: torch_dist (any layout loads it; megatron-core
                            too), fsdp_dtensor (Megatron-FSDP's), or legacy torch files split for
                            TP x PP; load it with --finetune

Full state dicts are TP=1 tensors under megafab's local-spec names (convert/state_dict.py). Runs in
one process, without a process group; each phase shows a bar on a terminal and is one log line
otherwise (megafab.progress).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch

from megafab import checks
from megafab import param_names as keys
from megafab.checkpoint import formats, fsdp_dtensor, layout, megatron_dist, megatron_keys, megatron_legacy
from megafab.checkpoint.checkpointing import open_source
from megafab.checkpoint.directory import TRACKER, commit_checkpoint, iteration_dir
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.megatron_args import unknown_model
from megafab.checkpoint.source import CommonRecord, run_layout
from megafab.checkpoint.vocab import padded_rows
from megafab.config import Config, pad_vocab_size
from megafab.config.moe import moe_settings
from megafab.convert.state_dict import ConversionError, finalize_model_config
from megafab.progress import progress


def _phase(items, desc: str):
    """A conversion phase: a bar on a terminal, one line in a log (megafab.progress)."""
    return progress(list(items), desc=desc, unit="step", announce=True)


def open_checkpoint(load_dir: str, iteration: int | None = None):
    """(CheckpointSource, Config) of the checkpoint in load_dir (the tracker's, or `iteration`)."""
    if iteration is None:
        found = formats.find_checkpoint(load_dir)
        if found is None:
            raise ConversionError(f"{load_dir} holds no checkpoint ({TRACKER} not found); pass the directory "
                                  f"given to --save")
    else:
        path = iteration_dir(load_dir, iteration)
        if not os.path.isdir(path):
            raise ConversionError(f"{path} does not exist; pass an iteration that was saved")
        found = formats.Found(path, iteration, False, formats.detect_format(path))
    source = open_source(found, None)
    if source.saved_args is None:
        raise unknown_model(found.path)
    flat = {**source.saved_args, "transformer_impl": "local"}  # full state dicts use local-spec names
    cfg = Config.from_flat(flat)
    cfg = dataclasses.replace(cfg, model=finalize_model_config(flat, cfg.parallel.tensor_model_parallel_size))
    return open_source(found, cfg.model), cfg


def read_checkpoint(load_dir: str, iteration: int | None = None,
                    opened=None) -> tuple[dict[str, torch.Tensor], Config]:
    """The full megafab state dict and the Config of a checkpoint (latest by default; `opened`: what
    open_checkpoint returned for it)."""
    source, cfg = opened or open_checkpoint(load_dir, iteration)
    names = sorted(megatron_keys.model_names(source.stored), key=keys.layer_order)
    if not names:
        raise ConversionError(f"{source.path} holds no model tensors; it cannot be converted")
    sd = {}
    for group in _phase(_by_layer(names), f"reading {source.format}"):
        shards = {layout.model_key(n): layout.Shard.whole(torch.empty(
            tuple(source.stored[layout.model_key(n)].size),
            dtype=source.stored[layout.model_key(n)].properties.dtype)) for n in group}
        source.read(shards)
        sd.update({n: layout.from_stored(n, shards[layout.model_key(n)].views[0], cfg.model) for n in group})
    padded = sd[keys.WORD_EMBEDDING].shape[0]
    vocab = cfg.model.vocab_size or padded  # Megatron records only the padded size
    return sd, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, padded_vocab_size=padded,
                                                                   vocab_size=vocab))


def _by_layer(names: list[str]) -> list[list[str]]:
    groups: dict = {}
    for n in names:
        groups.setdefault(keys.layer_of(n), []).append(n)
    return list(groups.values())


def repad_vocab(sd: dict[str, torch.Tensor], padded: int) -> dict[str, torch.Tensor]:
    """The vocabulary padded to `padded` rows as training pads it (Megatron reads no other padding),
    by the rule loading a checkpoint padded otherwise follows (megafab.checkpoint.vocab)."""
    out = dict(sd)
    for name in keys.VOCAB_PADDED:
        if name in out:
            out[name] = padded_rows(out[name], padded)
    return out


def target_config(cfg: Config, tp: int | None = None, pp: int | None = None, ep: int | None = None) -> Config:
    """The Config a checkpoint converted from `cfg`'s model records: TP `tp` x PP `pp` x EP `ep`
    (default: the source's; ETP = TP, 1 for experts with biases as Megatron requires; one model chunk
    per stage), the vocabulary padded for `tp`.
    Every rule of megafab.checks that this layout breaks with this model -> one ConversionError."""
    p, m = cfg.parallel, cfg.model
    sizes = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
             "expert_model_parallel_size": ep}
    sizes = {k: (getattr(p, k) or 1) if v is None else v for k, v in sizes.items()}
    tp = sizes["tensor_model_parallel_size"]
    etp = 1 if m.add_bias_linear and cfg.moe.num_experts is not None else tp
    target = dataclasses.replace(cfg, parallel=dataclasses.replace(
        p, **sizes, expert_tensor_parallel_size=etp, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None))
    # Checked for any world the run launches, with the sequence parallelism MoE under TP needs: the
    # run that loads the checkpoint chooses both.
    checked = dataclasses.replace(target, parallel=dataclasses.replace(
        target.parallel, world_size=None, sequence_parallel=p.sequence_parallel or tp > 1,
        expert_tensor_parallel_size=etp if tp >= 1 else None))  # a bad TP is reported once
    problems = checks.model_layout_problems(checked)
    if problems:
        lines = "\n".join(f"  - {line}" for line in problems)
        given = " x ".join(f"--target-{axis}-parallel-size {sizes[f'{name}_model_parallel_size']}"
                           for axis, name in (("tensor", "tensor"), ("pipeline", "pipeline"),
                                              ("expert", "expert")))
        raise ConversionError(f"{given} (a size not given is the source's) cannot hold this model; "
                              f"{len(problems)} problem(s), named by the training flags these sizes "
                              f"become:\n{lines}")
    padded = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    return dataclasses.replace(target, model=dataclasses.replace(m, padded_vocab_size=padded))


def write_checkpoint(save_dir: str, sd: dict[str, torch.Tensor], cfg: Config, iteration: int = 0,
                     ckpt_format: str = formats.TORCH_DIST, tp: int | None = None,
                     pp: int | None = None, ep: int | None = None) -> str:
    """Write `sd` (full megafab state dict) as a weights-only checkpoint of iteration `iteration`,
    recorded as saved at TP `tp` x PP `pp` x EP `ep` (target_config; EP names the legacy format's
    expert files, torch_dist is the same at any EP); see the module docstring."""
    if ckpt_format not in formats.CKPT_FORMATS:
        raise ConversionError(f"checkpoint format {ckpt_format!r} is not one of {formats.CKPT_FORMATS}")
    cfg = target_config(cfg, tp, pp, ep)  # the caller's config stays as it is
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    etp = cfg.parallel.expert_tensor_parallel_size
    if ckpt_format == formats.TORCH and cfg.moe.num_experts is not None and etp != tp:
        raise ConversionError(f"legacy torch files split the experts at ETP = TP {tp}, and experts with "
                              f"biases train at --expert-tensor-parallel-size 1; write torch_dist (any "
                              f"layout loads it) or --target-tensor-parallel-size 1")
    sd = repad_vocab(sd, cfg.model.padded_vocab_size)
    final = iteration_dir(save_dir, iteration)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    record = CommonRecord(iteration, run_layout(tp, pp, 1), cfg.to_flat())  # weights only
    if ckpt_format == formats.TORCH_DIST:
        _write_torch_dist(tmp, sd, cfg, record)
    elif ckpt_format == formats.FSDP_DTENSOR:
        _write_fsdp_dtensor(tmp, sd, cfg, record)
    else:
        _write_legacy(tmp, sd, cfg, record, tp, pp)
    commit_checkpoint(save_dir, iteration)  # the training saver's rename + tracker, same guarantees
    return final


def _write_torch_dist(tmp, sd, cfg, record) -> None:
    # deferred: torch.distributed.checkpoint costs seconds to import; only torch_dist writes pay it
    from megafab.checkpoint import dcp_io

    shards = {layout.model_key(n): layout.Shard.whole(layout.to_stored(n, t.contiguous(), cfg.model))
              for n, t in sd.items()}
    moe = moe_settings(cfg)
    stacked, layers = megatron_keys.stacks_layers(moe), range(cfg.model.num_layers)
    objects = megatron_dist.extra_state_objects(layers, cfg.model.num_layers, moe, stacked, cfg.model)
    objects.update(megatron_dist.mtp_extra_state_objects(cfg.model, moe))
    if moe is not None:
        objects.update(megatron_dist.expert_extra_state_objects(layers, cfg.model.num_layers, moe,
                                                                range(moe.num_experts), stacked))
        objects.update(megatron_dist.mtp_expert_extra_state_objects(cfg.model, moe, range(moe.num_experts)))
    for _ in _phase([0], "writing torch_dist"):
        dcp_io.save_shards(megatron_dist.megatron_shards(shards, cfg.model, False, stacked), tmp, objects)
    megatron_dist.write_common(tmp, megatron_dist.common_state(cfg, record, None, None, False))


def _write_fsdp_dtensor(tmp, sd, cfg, record) -> None:
    # deferred: torch.distributed.checkpoint costs seconds to import; only DCP writes pay it
    from megafab.checkpoint import dcp_io

    shards = {layout.model_key(n): layout.Shard.whole(layout.to_stored(n, t.contiguous(), cfg.model))
              for n, t in sd.items()}
    objects = fsdp_dtensor.common_objects(cfg, record, None)
    for _ in _phase([0], "writing fsdp_dtensor"):
        dcp_io.save_shards(fsdp_dtensor.to_fsdp(shards, cfg), tmp, objects)


def _write_legacy(tmp, sd, cfg, record, tp, pp) -> None:
    common = megatron_dist.megatron_common(cfg, record, formats.TORCH, None)
    ep = cfg.parallel.expert_model_parallel_size if cfg.moe.num_experts is not None else 1
    ranks = [(t, p, e) for p in range(pp) for e in range(ep) for t in range(tp)]
    for tp_rank, pp_rank, ep_rank in _phase(ranks, "writing torch"):
        model = megatron_legacy.rank_state_dict(sd, cfg.model, tp, tp_rank, pp, pp_rank, ep, ep_rank)
        megatron_legacy.write_rank_file(tmp, tp_rank, pp_rank, pp, common, {keys.chunk_key(0, 1): model},
                                        ep_rank, ep)


__all__ = ["CheckpointError", "ConversionError", "open_checkpoint", "read_checkpoint", "target_config",
           "write_checkpoint"]
