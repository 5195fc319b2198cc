"""--async-save's host staging memory: one shared-memory block per rank (a memfd; a deleted temporary
file where there is none) that holds the host copy of every tensor the rank writes, each at an
aligned offset. Saves whose tensors have the same shapes and dtypes reuse it; the writer process
(writer_process.py) maps the same block, so a save hands it offsets, never tensor bytes. On CUDA
the block is registered as pinned memory (cudaHostRegister) so the device-to-host copies are
asynchronous DMA.

    arena = StagingArena(layout)          layout: ((shape, dtype), ...), in staging order
    arena.views[i]                         the i-th tensor's host buffer
    arena.offsets[i], arena.size, arena.fd
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile

import torch

ALIGN = 64  # bytes; every dtype's view of the block starts on a multiple of its element size


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _shared_fd(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("megafab-checkpoint-staging")
    else:  # macOS: an unlinked temporary file, in /dev/shm where there is one
        with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None,
                                         delete=False) as f:
            fd = os.dup(f.fileno())
            os.unlink(f.name)
    os.ftruncate(fd, size)
    return fd


class StagingArena:
    def __init__(self, layout: tuple, device_type: str = "cpu"):
        self.layout = layout
        self.offsets, size = [], 0
        for shape, dtype in layout:
            self.offsets.append(size)
            size += -(-_nbytes(shape, dtype) // ALIGN) * ALIGN
        self.size = max(size, ALIGN)
        self.fd = _shared_fd(self.size)
        self.map = mmap.mmap(self.fd, self.size)
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        self.base = whole.data_ptr()
        self.views = [view_at(whole, o, shape, dtype) for o, (shape, dtype) in zip(self.offsets, layout)]
        self.pinned = device_type == "cuda" and _pin(whole)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
        os.close(self.fd)


def _pin(whole: torch.Tensor) -> bool:
    """GPU-only path: page-lock the block so that copy_(non_blocking=True) is a real async copy."""
    return int(torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), whole.numel(), 0)) == 0


def view_at(block: torch.Tensor, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """The tensor at `offset` of a mapped block (the writer process's side of `views`)."""
    return block[offset:offset + _nbytes(shape, dtype)].view(dtype).view(shape)
