"""Optimizer CPU offload (Megatron's --optimizer-cpu-offload, --optimizer-offload-fraction).

The first entries of the optimizer (in model order) that make up `fraction` of this rank's
elements keep their fp32 main params and Adam state in host memory, and torch's AdamW steps them
on the CPU (fused where torch has it, else foreach). The device keeps the model weights and
gradients and the other entries' state. One step (HostOptimizer.step), after the device-side norm
and clip, pipelines pieces of the entries: piece k's grads are copied to the host, stepped while
piece k+1 copies, and its new weights copied back while piece k+1 steps.

Host bytes per offloaded element: main 4 + Adam 8 + grad buffer 4 (+ the device grad's own dtype
for the copy when it is not fp32, + the model dtype for the H2D copy when it is not the main's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megafab.errors import MegafabError

MAX_PIECES = 4


class OffloadConfigError(MegafabError):
    """An offload setting that cannot work; the message names the value and the fix."""


def offload_problems(fraction: float) -> list[str]:
    """Why --optimizer-offload-fraction cannot be used (the config check asks this before start)."""
    if not 0.0 <= fraction <= 1.0:
        return [f"--optimizer-offload-fraction {fraction} must be in [0, 1] (the share of the optimizer "
                f"state kept on the CPU)"]
    return []


@dataclass(frozen=True)
class OffloadConfig:
    fraction: float = 1.0
    """Share of this rank's optimizer elements kept and stepped on the host."""
    pin_grads: bool = True
    """Page-locked host grad buffers (CUDA only): asynchronous D2H copies."""
    pin_params: bool = True
    """Page-locked host main params (CUDA only): asynchronous H2D copies."""

    def __post_init__(self):
        problems = offload_problems(self.fraction)
        if problems:
            raise OffloadConfigError(problems[0])


def split_for_offload(entries: list, fraction: float) -> tuple[list, list]:
    """(host entries, device entries): in order, an entry goes to the host while the host's
    elements stay within `fraction` of the total (Megatron's HybridDeviceOptimizer rule)."""
    total = sum(e.main.numel() for e in entries)
    budget, used = fraction * total, 0
    host, device = [], []
    for e in entries:
        if used + e.main.numel() <= budget:
            host.append(e)
            used += e.main.numel()
        else:
            device.append(e)
    return host, device


def _pieces(entries: list, count: int) -> list[list]:
    """Consecutive runs of entries with about the same number of elements each."""
    total = sum(e.main.numel() for e in entries)
    pieces, current, filled = [], [], 0
    for e in entries:
        current.append(e)
        filled += e.main.numel()
        if filled >= total * (len(pieces) + 1) / count and len(pieces) < count - 1:
            pieces.append(current)
            current = []
    if current:
        pieces.append(current)
    return pieces


def _host_empty(like: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=dtype, device="cpu", pin_memory=pin)


class _Piece:
    """Entries stepped together: their host buffers, their torch optimizer, their D2H event."""

    def __init__(self, entries: list, cfg: OffloadConfig, cuda: bool):
        self.entries = entries
        pin_grads, pin_params = cfg.pin_grads and cuda, cfg.pin_params and cuda
        self.grads = [_host_empty(e.main, e.main.dtype, pin_grads) for e in entries]
        # The D2H copy lands in the device grad's dtype; grads already in the main's dtype land in
        # `grads` directly.
        self.staged_grads = [g if e.grad_dtype == g.dtype else _host_empty(g, e.grad_dtype, pin_grads)
                             for e, g in zip(entries, self.grads)]
        self.staged_params = [None if e.main.dtype == e.model_dtype else
                              _host_empty(e.main, e.model_dtype, pin_params) for e in entries]
        self.optimizer = None
        self.copied = None  # CUDA event: this piece's grads are on the host


class HostOptimizer:
    """The host side of one optimizer: host mains, their Adam state and the grads' host buffers.

    entries: the MainParams to offload; each gets a host main (a copy of its current main).
    make_optimizer(mains) -> the torch optimizer over those host tensors (param groups included).
    """

    def __init__(self, entries: list, make_optimizer, cfg: OffloadConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.cuda = device.type == "cuda"
        for e in entries:
            host = _host_empty(e.main, e.main.dtype, cfg.pin_params and self.cuda)
            host.copy_(e.main.detach())
            e.main = host
            e.host = True
        self.entries = entries
        self.pieces = [_Piece(p, cfg, self.cuda) for p in (_pieces(entries, MAX_PIECES) if entries else [])]
        for piece in self.pieces:
            piece.optimizer = make_optimizer(piece.entries)
        self._d2h = torch.cuda.Stream(device) if self.cuda else None
        self._h2d = torch.cuda.Stream(device) if self.cuda else None

    @property
    def torch_optimizers(self) -> list:
        return [p.optimizer for p in self.pieces]

    def device_grads(self) -> list[torch.Tensor]:
        """The offloaded entries' gradients where backward left them (on the device, still scaled
        by the fp16 loss scale), zeros for entries without one."""
        out = []
        for e in self.entries:
            g = e.model_grad()
            out.append(torch.zeros(e.main.shape, dtype=e.main.dtype, device=self.device) if g is None else g)
        return out

    def _stream(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _start_copies_to_host(self, device_grads: list[torch.Tensor]) -> None:
        if self._d2h is not None:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        index = 0
        with self._stream(self._d2h):
            for piece in self.pieces:
                for staged in piece.staged_grads:
                    staged.copy_(device_grads[index].reshape(staged.shape), non_blocking=self.cuda)
                    index += 1
                if self._d2h is not None:
                    piece.copied = self._d2h.record_event()

    def _copy_piece_to_device(self, piece: _Piece) -> None:
        if self._h2d is not None:
            self._h2d.wait_stream(torch.cuda.current_stream(self.device))
        with self._stream(self._h2d):
            for e, staged in zip(piece.entries, piece.staged_params):
                source = e.main
                if staged is not None:
                    staged.copy_(e.main)
                    source = staged
                e.model_values().view(source.shape).copy_(source, non_blocking=self.cuda)

    @torch.no_grad()
    def step(self, multiplier: float, device_grads: list[torch.Tensor]) -> None:
        """Copy the grads to the host, scale them by `multiplier` (1/loss scale x clip coefficient),
        step each piece as soon as its copy landed, and copy the new weights back:

            device grads ──D2H──> host grad buffers           piece 0 | piece 1 | piece 2 | ...
            host AdamW step (piece k)                          while piece k+1 is still copying
            host mains ──H2D──> device weights (model dtype)   while piece k+1 steps

        On CUDA the copies run on their own streams and every piece waits only for its own copy,
        so the transfers overlap the CPU's optimizer math (Megatron's
        --overlap-cpu-optimizer-d2h-h2d; megafab always overlaps); host buffers are pinned unless
        --no-pin-cpu-grads / --no-pin-cpu-params. The current stream waits for the last H2D before
        the step returns, so the distributed optimizer's or FSDP2's all-gather reads the new
        weights. On a CPU device the same code copies between tensors in one memory. The
        multiplier is applied in fp32 after the copy, so 16-bit device grads are never unscaled in
        16 bits."""
        self._start_copies_to_host(device_grads)
        for piece in self.pieces:
            if piece.copied is not None:
                piece.copied.synchronize()
            for e, grad, staged in zip(piece.entries, piece.grads, piece.staged_grads):
                if staged is not grad:
                    grad.copy_(staged)
                if multiplier != 1.0:
                    grad.mul_(multiplier)
                e.main.grad = grad
            piece.optimizer.step()
            for e in piece.entries:
                e.main.grad = None
            self._copy_piece_to_device(piece)
        if self._h2d is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._h2d)

    @torch.no_grad()
    def copy_to_device(self) -> None:
        """Every host main into its model weights (after a checkpoint load)."""
        for piece in self.pieces:
            self._copy_piece_to_device(piece)
        if self._h2d is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._h2d)

    def host_tensors(self) -> list[torch.Tensor]:
        """Every host buffer this offload owns (for memory accounting): mains and copy buffers."""
        out = [e.main for e in self.entries]
        for piece in self.pieces:
            out += piece.grads + piece.staged_grads + [t for t in piece.staged_params if t is not None]
        return out
