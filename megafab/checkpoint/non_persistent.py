"""Megatron's global non-persistent checkpoints (--non-persistent-save-interval,
--non-persistent-ckpt-type global): frequent torch_dist saves into their own directory,
--non-persistent-global-ckpt-dir or SAVE/non_persistent (LOAD/non_persistent when loading), where
only the newest is kept (older ones are removed when the next one starts, as Megatron does). A load
takes the non-persistent checkpoint when it is at least as new as --load's (Megatron's rule).
"""

from __future__ import annotations

import os
import shutil

from megafab.checkpoint.directory import ITERATION_DIR, TRACKER, latest_iteration

SUBDIR = "non_persistent"


def enabled(ck) -> bool:
    return ck.non_persistent_ckpt_type == "global"


def save_root(ck) -> str:
    return ck.non_persistent_global_ckpt_dir or os.path.join(ck.save, SUBDIR)


def load_root(ck, load_dir: str | None) -> str | None:
    if not enabled(ck):
        return None
    return ck.non_persistent_global_ckpt_dir or (os.path.join(load_dir, SUBDIR) if load_dir else None)


def newest(root: str | None) -> int | None:
    if root is None or not os.path.isfile(os.path.join(root, TRACKER)):
        return None
    return latest_iteration(root)


def remove_older(root: str) -> None:
    """Rank 0, before a non-persistent save: every iter_N in `root` but the one the tracker names."""
    keep = newest(root)
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        match = ITERATION_DIR.match(name.removesuffix(".tmp").removesuffix(".old"))
        if match and int(match.group(1)) != keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def choose_load_dir(ck, load_dir: str | None) -> tuple[str | None, str | None]:
    """(the directory to load from, a note saying which and why, or None)."""
    root = load_root(ck, load_dir)
    if root is None or ck.ckpt_step is not None:
        return load_dir, None
    theirs, persistent = newest(root), newest(load_dir) if load_dir else None
    if theirs is not None and (persistent is None or theirs >= persistent):
        return root, (f"loading the non-persistent checkpoint of iteration {theirs} from {root} (--load "
                      f"{load_dir} holds {'none' if persistent is None else f'iteration {persistent}'})")
    then = "training from scratch" if persistent is None else \
        f"loading iteration {persistent} of --load {load_dir}"
    why = "holds none" if theirs is None else f"holds iteration {theirs}, older"
    return load_dir, f"the non-persistent checkpoint directory {root} {why}: {then}"
