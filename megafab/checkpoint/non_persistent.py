"""Megatron's non-persistent checkpoints (--non-persistent-save-interval, --non-persistent-ckpt-type):
frequent torch_dist saves into their own directory, --non-persistent-global-ckpt-dir or
SAVE/non_persistent (global; LOAD/non_persistent when loading) or the node-local
--non-persistent-local-ckpt-dir (local: one-node jobs, check_one_node), where older ones are removed
when the next one starts (as Megatron does). A load takes the non-persistent checkpoint when it is
at least as new as --load's (Megatron's rule).
"""

from __future__ import annotations

import os
import shutil
import socket

import torch.distributed as dist

from megafab.checkpoint.directory import ITERATION_DIR, TRACKER, latest_iteration
from megafab.checkpoint.errors import CheckpointError

SUBDIR = "non_persistent"


def enabled(ck) -> bool:
    return ck.non_persistent_ckpt_type in ("global", "local")


def save_root(ck) -> str:
    if ck.non_persistent_ckpt_type == "local":
        return ck.non_persistent_local_ckpt_dir
    return ck.non_persistent_global_ckpt_dir or os.path.join(ck.save, SUBDIR)


def load_root(ck, load_dir: str | None) -> str | None:
    if not enabled(ck):
        return None
    if ck.non_persistent_ckpt_type == "local":
        return ck.non_persistent_local_ckpt_dir
    return ck.non_persistent_global_ckpt_dir or (os.path.join(load_dir, SUBDIR) if load_dir else None)


def check_one_node(ck, topo) -> None:
    """Collective (local type only): every rank runs on one host, since each node would otherwise hold
    only its own ranks' files (and rank 0's .metadata), which megafab cannot load."""
    if ck.non_persistent_ckpt_type != "local":
        return
    hosts = [None] * topo.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    if len(set(hosts)) > 1:
        raise CheckpointError(f"--non-persistent-ckpt-type local with ranks on {len(set(hosts))} hosts: "
                              f"megafab's local checkpoints are torch_dist files, loadable only when one "
                              f"node holds all of them; use --non-persistent-ckpt-type global on shared "
                              f"storage, or run on one node")


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
