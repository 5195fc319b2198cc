"""torch.distributed.checkpoint (DCP) for tensors that each rank holds as one rectangular piece of
a global tensor.

A `Shard` says: this local tensor is the block of the global tensor of shape `global_shape` that
starts at `offsets`. DCP stores every block under the global shape, so a reader with any other
split asks for its own block and DCP assembles it from whatever blocks were written. Ranks that
hold the same block (data-parallel replicas, TP-replicated params) write identical
(key, offsets) entries; DCP's planner keeps one of them.

No pickled code is ever executed on load: tensors are read by DCP as raw storage, and DCP's
`.metadata` file (a pickle of its own dataclasses) is read with an unpickler that admits only
those dataclasses, torch.Size and torch dtype/layout/memory-format constants.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megafab.training.checkpoint_shard import CheckpointError, Shard

VOCAB_TENSORS = ("word_embeddings", "output_layer")


def _write_item(fqn: str, shard: Shard) -> WriteItem:
    t = shard.tensor
    offsets = torch.Size(shard.offsets)
    whole = tuple(t.shape) == tuple(shard.global_shape)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                                    properties=TensorProperties.create_from_tensor(t),
                                    size=torch.Size(shard.global_shape)))


class _ShardSavePlanner(DefaultSavePlanner):
    """DCP's default planner (dedup of replicas included) fed with explicit global blocks; DCP
    sees the plain local tensors, the planner places them."""

    def __init__(self, shards: dict[str, Shard]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([_write_item(fqn, s) for fqn, s in self.shards.items()])
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.shards[index.fqn].tensor


class _ShardLoadPlanner(DefaultLoadPlanner):
    """Reads each requested block out of whatever blocks the checkpoint holds for its key."""

    def __init__(self, shards: dict[str, Shard]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for fqn, shard in self.shards.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            check_stored_shape(fqn, md, shard.global_shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size(shard.offsets), sizes=shard.tensor.size())
            requests += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.shards[index.fqn].tensor


def check_stored_shape(fqn: str, md, global_shape) -> None:
    if md is None:
        raise CheckpointError(
            f"the checkpoint has no tensor {fqn!r}; it was saved from a different model (or without "
            f"this state); load a matching checkpoint, or pass --no-load-optim / --finetune")
    if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(global_shape):
        stored = tuple(md.size) if isinstance(md, TensorStorageMetadata) else type(md).__name__
        vocabulary = (isinstance(md, TensorStorageMetadata) and len(stored) == len(global_shape)
                      and stored[0] != global_shape[0] and tuple(stored[1:]) == tuple(global_shape[1:])
                      and any(name in fqn for name in VOCAB_TENSORS))
        hint = ("the padded vocabulary differs: pick --make-vocab-size-divisible-by (times the "
                "tensor-parallel size) and the tokenizer the checkpoint was saved with") if vocabulary else \
            "the checkpoint was saved from a model of another shape"
        raise CheckpointError(f"checkpoint tensor {fqn!r} has global shape {stored} but this model needs "
                              f"{tuple(global_shape)}; {hint}")


# ---- safe metadata -----------------------------------------------------------------------------
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
# A dict lookup from a layout's name, and the checkpoint path DCP records in StorageMeta.
_SAFE_CALLABLES = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                   ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses/enums and torch's Size and dtype-like constants only."""

    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, _TORCH_CONSTANTS):
                return obj
        elif (module, name) in _SAFE_CALLABLES:
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which a DCP metadata "
                              f"file never holds; refusing to unpickle it (the file is corrupt or unsafe)")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of the checkpoint directory `path` (keys, global shapes, chunks)."""
    return SafeFileSystemReader(path).read_metadata()


def check_shards(shards: dict[str, Shard], path: str) -> None:
    """Raise one CheckpointError (before any collective) if a key is missing or shaped otherwise."""
    stored = read_metadata(path).state_dict_metadata
    for fqn, shard in shards.items():
        check_stored_shape(fqn, stored.get(fqn), shard.global_shape)


def save_shards(shards: dict[str, Shard], path: str) -> None:
    """Collective over the default process group: write every rank's shards into `path`."""
    dcp.save({k: s.tensor for k, s in shards.items()}, storage_writer=FileSystemWriter(path, thread_count=1),
             planner=_ShardSavePlanner(shards))


def load_shards(shards: dict[str, Shard], path: str) -> None:
    """Collective: fill every Shard's tensor in place from the checkpoint in `path` (also works
    in a process without torch.distributed, e.g. a conversion tool)."""
    try:
        dcp.load({k: s.tensor for k, s in shards.items()}, storage_reader=SafeFileSystemReader(path),
                 planner=_ShardLoadPlanner(shards), no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP gathers every rank's failure into one exception
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: reading its tensors failed ({type(e).__name__}: {first}); the "
                              f"checkpoint is damaged: load an older one") from None
