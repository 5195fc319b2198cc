"""Megatron-layout checkpoints (work in progress: being written)."""

import os

TRACKER = "latest_checkpointed_iteration.txt"


def latest_iteration(save_dir: str) -> int | None:
    path = os.path.join(save_dir, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return int(f.read().strip())


def save_checkpoint(state):
    raise NotImplementedError("checkpoint saving is being written")


def load_checkpoint(state):
    raise NotImplementedError("checkpoint loading is being written")
