"""Which checkpoint a --load directory holds, told by its own files, and Megatron's format flags.

    torch_dist   Megatron-LM's distributed checkpoint: metadata.json + DCP files (+ common.pt);
                 what megafab writes (--ckpt-format torch_dist, the default)
    torch        Megatron-LM's legacy format: mp_rank_XX[_YYY]/model_optim_rng.pt per TP/PP rank
                 (--ckpt-format torch)
    megafab      megafab's own earlier format: common.json + DCP files under model.* / optim.* keys;
                 still read, no longer written (torch_dist holds everything it did)
    fsdp_dtensor Megatron-LM's Megatron-FSDP format: DCP files only (.metadata, `model.` keys, args and
                 counters as DCP objects; fsdp_dtensor.py); Megatron's torch_dcp has the same files and
                 is refused by fsdp_dtensor.py when it holds no `model.` weights

As in Megatron, --ckpt-format torch_dist (or --auto-detect-ckpt-format) loads whatever the directory
holds (here fsdp_dtensor too); --ckpt-format torch alone expects the legacy format. A directory that
is none of these -- empty, a save that did not finish, another tool's files -- is refused naming what
was found.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megafab.checkpoint.directory import COMMON, RELEASE, TRACKER, existing_iteration_dir, read_tracker
from megafab.checkpoint.errors import CheckpointError
from megafab.config import CKPT_FORMATS  # noqa: F401 - the values of --ckpt-format

TORCH_DIST, TORCH, MEGAFAB, FSDP_DTENSOR = "torch_dist", "torch", "megafab", "fsdp_dtensor"
METADATA_JSON = "metadata.json"
LEGACY_PREFIX = "mp_rank_"
DCP_METADATA = ".metadata"
EXPECTED = (f"{METADATA_JSON} + DCP files (Megatron torch_dist), {LEGACY_PREFIX}XX[_YYY]/model_optim_rng.pt "
            f"(Megatron torch), DCP files alone (Megatron fsdp_dtensor), or {COMMON} + DCP files (megafab)")


@dataclass(frozen=True)
class Found:
    """A checkpoint the tracker file of a --load directory names."""

    path: str
    iteration: int
    release: bool
    format: str


def find_checkpoint(load_dir: str, step: int | None = None) -> Found | None:
    """The checkpoint in load_dir: iteration `step` (Megatron's --ckpt-step), else the one its tracker
    file names; None without either (training starts fresh)."""
    tracked = step if step is not None else read_tracker(load_dir)
    if tracked is None:
        return None
    path = existing_iteration_dir(load_dir, tracked)
    release = tracked == RELEASE
    return Found(path, 0 if release else tracked, release, detect_format(path))


def detect_format(path: str) -> str:
    names = sorted(os.listdir(path))
    if METADATA_JSON in names:
        return TORCH_DIST
    if COMMON in names:
        return MEGAFAB
    if any(n.startswith(LEGACY_PREFIX) for n in names):
        return TORCH
    if DCP_METADATA in names:  # a torch_dist save that did not finish has no .metadata yet either
        return FSDP_DTENSOR
    if not names:
        found = "nothing (an empty directory: a save that did not finish, or a failed copy)"
    else:
        found = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    raise CheckpointError(f"{path} holds {found}; a checkpoint directory holds {EXPECTED}. Point --load at "
                          f"a directory written by --save (its {TRACKER} names the iteration)")


def check_requested_format(found: Found, ckpt_format: str, auto_detect: bool) -> None:
    """Megatron's rule: without --auto-detect-ckpt-format, --ckpt-format torch loads legacy only."""
    if auto_detect or ckpt_format != TORCH or found.format == TORCH:
        return
    raise CheckpointError(
        f"{found.path} is a {found.format} checkpoint but --ckpt-format torch expects the legacy format "
        f"({LEGACY_PREFIX}XX/model_optim_rng.pt); pass --auto-detect-ckpt-format, or --ckpt-format "
        f"torch_dist")
