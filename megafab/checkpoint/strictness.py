"""--dist-ckpt-strictness: key mismatches between the model and a DCP checkpoint, handled as
megatron-core's dist_checkpointing StrictHandling handles them.

Megatron's words: an "unexpected" key is one this rank's model asks for and the checkpoint lacks;
a "missing" key is one the checkpoint holds and no rank asks for. assume_ok_unexpected (the default)
checks nothing beforehand: an unexpected key stops the load as the read would. *_unexpected look at
the unexpected keys only, *_all at both (one exchange of the asked-for keys over the ranks). log_*
warn, raise_* stop with the keys named, return_* and ignore_all say nothing; whatever is not raised
is left out of the read: those parameters keep their initial values, those Adam moments start at 0.
"""

from __future__ import annotations

import torch.distributed as dist

from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import MAIN_PARAM, STEP, split_key

SHOWN = 8  # keys named in one message


def _listed(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:SHOWN]) + (f" ... ({len(keys)} in all)" if len(keys) > SHOWN else "")


def unexpected_keys(shards: dict, stored) -> list[str]:
    """The keys of `shards` (this rank's reads) the checkpoint does not hold; Adam's step, which
    Megatron keeps outside the tensors, is never one."""
    return sorted(k for k in shards if k not in stored and split_key(k)[1] != STEP)


def mismatches(strictness: str, shards: dict, stored, world: bool = True) -> tuple[list[str], list[str]]:
    """(unexpected keys of any rank, missing keys) as `strictness` looks for them (collective over
    the default group when it needs the missing ones or names every rank's unexpected ones)."""
    if strictness == "assume_ok_unexpected":
        return [], []
    local = unexpected_keys(shards, stored)
    wants_missing = strictness.endswith("_all")
    if not (world and dist.is_initialized() and dist.get_world_size() > 1):
        asked = set(shards)
        return local, sorted(set(stored) - asked) if wants_missing else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, list(shards) if wants_missing else []))
    unexpected = sorted({k for keys, _ in gathered for k in keys})
    asked = {k for _, keys in gathered for k in keys}
    return unexpected, sorted(set(stored) - asked) if wants_missing else []


def message(path: str, unexpected: list[str], missing: list[str]) -> str:
    parts = []
    if unexpected:
        parts.append(f"the model asks for {len(unexpected)} key(s) the checkpoint lacks (unexpected): "
                     f"{_listed(unexpected)}")
    if missing:
        parts.append(f"the checkpoint holds {len(missing)} key(s) the model does not load (missing): "
                     f"{_listed(missing)}")
    return f"{path}: " + "; ".join(parts)


def apply(strictness: str, shards: dict, path: str, unexpected: list[str], missing: list[str]) -> str | None:
    """Raise (raise_*), or leave this rank's unexpected keys out of `shards` (zeroing the optimizer
    moments they would have filled) and return the warning to print (log_*), None otherwise."""
    if strictness == "assume_ok_unexpected":
        return None
    if strictness.startswith("raise_") and (unexpected or missing):
        fix = "log_unexpected to start those parameters from their initial values" if unexpected else \
            "log_all to load it all the same"
        raise CheckpointError(message(path, unexpected, missing) + f" (--dist-ckpt-strictness {strictness}); "
                              f"load a checkpoint of this model, or pass --dist-ckpt-strictness {fix}")
    for key in set(unexpected) & set(shards):
        shard = shards.pop(key)
        kind = split_key(key)[1]
        if kind is not None and kind != MAIN_PARAM:  # a fresh Adam moment
            for view in shard.views:
                view.zero_()
    if strictness.startswith("log_") and (unexpected or missing):
        kept = ": the unexpected ones keep their initial values" if unexpected else ""
        return f"warning: {message(path, unexpected, missing)} (--dist-ckpt-strictness {strictness}{kept})"
    return None
