"""The unit a checkpoint stores: one rank's rectangular block of a global tensor.

Kept apart from checkpoint_io so that code which only describes checkpoints does not import
torch.distributed.checkpoint (seconds of import time per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megafab.errors import MegafabError


class CheckpointError(MegafabError):
    """A checkpoint that cannot be loaded here; the message names the key/file, the rule and the fix."""


@dataclass
class Shard:
    """`tensor` is the block of a global tensor of shape `global_shape` starting at `offsets`."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> Shard:
        return cls(tensor, tuple(tensor.shape), (0,) * tensor.dim())
