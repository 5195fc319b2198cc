"""Per-rank memory of training state, measured from the tensors that really exist.

weights: the model parameters (DDP's param buffer when the distributed optimizer holds them there;
the local shards under FSDP2);
grads: DDP's grad buffer, plus any `.grad` still alive (FSDP2: the local gradient shards);
optimizer: main params that are separate copies (fp32 masters / shards) and every tensor in the
torch optimizers' state (Adam exp_avg, exp_avg_sq, step), on the device;
host: what optimizer CPU offload keeps in host memory (mains, Adam state, copy buffers).
Every storage is counted once, even when several tensors view it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megafab.distributed.fsdp import local_tensor
from megafab.model.fp8_params import is_fp8_param, raw_tensors


@dataclass
class MemoryReport:
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    num_params: int  # parameters of this rank's model chunks (unsharded over DP)
    host_bytes: int = 0  # optimizer CPU offload's host memory

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes

    def per_param(self) -> dict[str, float]:
        n = max(self.num_params, 1)
        return {"weights": self.weights_bytes / n, "grads": self.grads_bytes / n,
                "optimizer": self.optimizer_bytes / n}


class _StorageCounter:
    def __init__(self):
        self.seen: set[int] = set()

    def bytes_of(self, tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            t = local_tensor(t)
            if is_fp8_param(t):  # TE's FP8 weight (an FSDP2 shard's local one): the tensors it holds
                total += self.bytes_of(raw_tensors(t))
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def measure_memory(model_chunks: list[nn.Module] | nn.Module, optimizer=None) -> MemoryReport:
    """Bytes of weights, grads and optimizer state held by this rank."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    counter = _StorageCounter()
    params = [p for c in chunks for p in c.parameters()]
    weights = counter.bytes_of(params)
    grad_tensors = [getattr(c, "grad_buffer", None) for c in chunks]
    grad_tensors += [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params]
    grads = counter.bytes_of(grad_tensors)
    opt = host = 0
    if optimizer is not None:
        offload = getattr(optimizer, "host", None)
        if offload is not None:
            host_state = [v for o in offload.torch_optimizers for s in o.state.values() for v in s.values()]
            host = counter.bytes_of(offload.host_tensors() + host_state)
        inners = getattr(optimizer, "torch_optimizers", [optimizer])
        mains = [e.main for e in getattr(optimizer, "entries", [])]
        state = [v for o in inners for s in o.state.values() for v in s.values()]
        opt = counter.bytes_of(mains + state)
    return MemoryReport(weights, grads, opt, sum(p.numel() for p in params), host)


class SavedActivations:
    """Counts what autograd keeps for backward inside a `with` block: the bytes of the distinct
    storages packed by saved-tensor hooks, parameters (and anything in `exclude`) left out.

        with SavedActivations(model.parameters()) as saved:
            loss = model(tokens, labels=labels)
        saved.bytes
    """

    def __init__(self, exclude=()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._bytes: int | None = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._storages[storage.data_ptr()] = storage
        return t

    @property
    def bytes(self) -> int:
        """Sized when the block ends: a storage freed before then (an output-discarding recompute
        region's, model/recompute.py) counts 0."""
        if self._bytes is not None:
            return self._bytes
        return sum(s.nbytes() for s in self._storages.values())

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._bytes = self.bytes
        self._storages.clear()
