"""Reading the pickled parts of Megatron-LM checkpoints without executing pickled code.

Megatron's `common.pt` (torch_dist), `model_optim_rng.pt` (legacy torch format) and the byte
objects inside torch_dist hold tensors, plain containers and a few classes: argparse.Namespace
(the run's args), SimpleNamespace, PosixPath, BytesIO, numpy arrays (RNG states), signal.Signals,
and megatron-core enums/dataclasses (AttnBackend, ModelType, RerunState, OptimizerConfig, ...).

They are read with torch's weights_only unpickler (torch.load(weights_only=True)), which admits
tensors and plain data only, widened by exactly those classes: the data classes above are
themselves, and every `megatron.*` class is an inert MegatronObject that records its name and
arguments (megafab never imports Megatron). Any other global the file names -- os.system, eval, a
class from elsewhere -- is refused by name before anything is unpickled.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import signal
import types

import numpy as np
import torch

from megafab.checkpoint.errors import CheckpointError

_NUMPY = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
try:  # numpy >= 2 pickles its arrays through numpy._core, older releases through numpy.core
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - numpy < 2
    from numpy.core.multiarray import _reconstruct
_DATA_CLASSES = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, pathlib.PurePosixPath,
                 io.BytesIO, signal.Signals, _reconstruct, *_NUMPY]
INERT_PREFIXES = ("megatron.",)
_READ_ERRORS = (RuntimeError, pickle.UnpicklingError, EOFError)


class MegatronObject:
    """Stands in for a megatron-core object (an enum member, a config dataclass): its qualified
    class name and the arguments/state it was pickled with, nothing run."""

    qualname = "megatron"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        inside = ", ".join(map(repr, self.args)) if self.args else ("..." if self.state else "")
        return f"{self.qualname}({inside})"

    def __eq__(self, other):
        return (isinstance(other, MegatronObject) and (self.qualname, self.args, self.state)
                == (other.qualname, other.args, other.state))

    __hash__ = None


def _stand_in(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[-1], (MegatronObject,), {"qualname": qualname})


def _full_name(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


_ALLOWED = {_full_name(c) for c in _DATA_CLASSES} | {"numpy.core.multiarray._reconstruct",
                                                     "numpy._core.multiarray._reconstruct"}


def _globals_for(source, what: str) -> list:
    """torch safe_globals entries for every non-default global `source` names; refuses the rest."""
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    if isinstance(source, io.BytesIO):
        source.seek(0)
    refused = sorted(n for n in names if n not in _ALLOWED and not n.startswith(INERT_PREFIXES))
    if refused:
        raise CheckpointError(
            f"{what} refers to {', '.join(refused)}, which a Megatron-LM checkpoint never holds; refusing "
            f"to unpickle it (it could run code). Re-save the checkpoint from a trusted Megatron-LM run")
    # Every data class, named or not: an object built by calling an allowed global (np.dtype('u4')
    # is a UInt32DType) must have an allowed type too for its state to be set.
    out = list(_DATA_CLASSES)
    for name in names:
        if name.endswith("multiarray._reconstruct"):
            out.append((_reconstruct, name))
        elif name.startswith(INERT_PREFIXES):
            out.append((_stand_in(name), name))
    return out


def load(path: str, mmap: bool = False):
    """torch.load of a Megatron-LM file (see the module docstring); tensors on CPU."""
    return _load(path, path, mmap)


def loads(data: bytes, what: str):
    """load() of bytes (a torch.save'd object stored inside a torch_dist checkpoint)."""
    return _load(data, what, False)


def _load(source, what: str, mmap: bool):
    try:
        # torch's context removes what it added on exit: never list what is registered already
        registered = set(torch.serialization.get_safe_globals())
        entries = [e for e in _globals_for(source, what) if e not in registered]
        with torch.serialization.safe_globals(entries):
            if isinstance(source, (bytes, bytearray)):
                return torch.load(io.BytesIO(source), map_location="cpu", weights_only=True)
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except _READ_ERRORS as e:
        raise CheckpointError(f"{what} could not be read as a torch file ({str(e).splitlines()[0]}); it is "
                              f"truncated or not a checkpoint: restore it from the original run") from None
