"""Per-rank memory of training state, measured from the tensors that really exist.

weights: the model parameters (DDP's param buffer when the distributed optimizer holds them there);
grads: DDP's grad buffer, plus any `.grad` still alive;
optimizer: main params that are separate copies (fp32 masters / shards) and every tensor in the
torch optimizer's state (Adam exp_avg, exp_avg_sq, step).
Every storage is counted once, even when several tensors view it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megafab.distributed.data_parallel import DistributedDataParallel


@dataclass
class MemoryReport:
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    num_params: int  # parameters of this rank's model chunks (unsharded count)

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
    grad_tensors = [c.grad_buffer for c in chunks if isinstance(c, DistributedDataParallel)]
    grad_tensors += [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params]
    grads = counter.bytes_of(grad_tensors)
    opt = 0
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)
        mains = [e.main for e in getattr(optimizer, "entries", [])]
        state = [v for s in inner.state.values() for v in s.values()]
        opt = counter.bytes_of(mains + state)
    return MemoryReport(weights, grads, opt, sum(p.numel() for p in params))


class SavedActivations:
    """Counts what autograd keeps for backward inside a `with` block: the bytes of the distinct
    storages packed by saved-tensor hooks, parameters (and anything in `exclude`) left out.

        with SavedActivations(model.parameters()) as saved:
            loss = model(tokens, labels=labels)
        saved.bytes
    """

    def __init__(self, exclude=()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
