"""torch.distributed.checkpoint (DCP) for Shards: every rank writes and reads a list of
rectangular boxes of each global tensor (megafab.checkpoint.layout).

DCP stores each written box as one chunk of the global tensor, under the global shape; a reader
asks for its own boxes and DCP assembles each from whatever chunks overlap it, so a checkpoint
written in one split reads in any other. A key may have several boxes per rank (DCP supports
several chunks per key): written items are indexed by (key, offsets), read requests by their
position in the rank's box list. Boxes written by more than one rank (replicas) must be identical
and DCP keeps one; DCP also checks that the written chunks of every key tile it exactly.

No pickled code is ever executed on load: tensors are read by DCP as raw storage, and DCP's
`.metadata` file (a pickle of its own dataclasses) is read with an unpickler that admits only
those dataclasses, torch.Size and torch dtype/layout/memory-format constants.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import os
import pickle
import warnings

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
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import Shard
from megafab.progress import Progress

LARGE = 1 << 30  # bytes on one rank from which a save or load shows a progress bar


def _bar(total_bytes: int, desc: str) -> Progress:
    return Progress(total_bytes, desc, enabled=None if total_bytes >= LARGE else False)


def _write_item(fqn: str, shard: Shard, box, view: torch.Tensor) -> WriteItem:
    offsets = torch.Size(box.offsets)
    whole = box.sizes == tuple(shard.global_shape)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box.sizes)),
                                    properties=TensorProperties.create_from_tensor(view),
                                    size=torch.Size(shard.global_shape)))


def _dcp_state_dict(shards: dict[str, Shard]) -> dict:
    """What dcp.save/load are handed; the planners below never look tensors up in it."""
    return {k: list(s.views) for k, s in shards.items()}


class _ShardSavePlanner(DefaultSavePlanner):
    """DCP's default planner (dedup of replicas, validation of the global plan) fed with the
    boxes of explicit Shards, and plain objects DCP torch.saves as bytes."""

    def __init__(self, shards: dict[str, Shard], objects: dict | None = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards, self.objects = shards, objects or {}
        self.views = {(fqn, box.offsets): view for fqn, s in shards.items() if s.write
                      for box, view in zip(s.boxes, s.views)}

    def create_local_plan(self) -> SavePlan:
        items = [_write_item(fqn, s, box, view) for fqn, s in self.shards.items() if s.write
                 for box, view in zip(s.boxes, s.views)]
        items += [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        self.progress = _bar(sum(self.views[(i.index.fqn, tuple(i.index.offset))].nbytes
                                 for i in plan.items if i.type != WriteItemType.BYTE_IO), "checkpoint save")
        return plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.objects:
            return self.objects[index.fqn]
        return _exact_storage(self.views[(index.fqn, tuple(index.offset))])

    def resolve_data(self, write_item: WriteItem):
        data = super().resolve_data(write_item)
        self.progress.update(getattr(data, "nbytes", 0))
        return data


def _exact_storage(view: torch.Tensor) -> torch.Tensor:
    """`view` on a storage of exactly its own bytes, sharing memory. DCP's writer clones a CPU tensor
    whose storage is larger than itself (every box of a flat buffer) and keeps each written tensor
    until the rank's file is closed: without this, a save would hold a copy of all it writes."""
    storage = view.untyped_storage()
    if view.device.type != "cpu" or not view.is_contiguous() or storage.nbytes() == view.nbytes:
        return view
    start = view.storage_offset() * view.element_size()
    return torch.empty(0, dtype=view.dtype).set_(storage[start:start + view.nbytes], 0, view.shape)


class _ShardLoadPlanner(DefaultLoadPlanner):
    """Reads each requested box out of whatever chunks the checkpoint holds for its key."""

    def __init__(self, shards: dict[str, Shard], path: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards, self.path = shards, path

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for fqn, shard in self.shards.items():
            if not shard.boxes:
                continue
            md = self.metadata.state_dict_metadata.get(fqn)
            check_stored_shape(self.path, fqn, md, shard.global_shape)
            chunks = [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes))
                      for b in shard.boxes]
            requests += create_read_items_for_chunk_list(fqn, md, chunks)
        self.progress = _bar(sum(math.prod(r.lengths) * self.lookup_tensor(r.dest_index).element_size()
                                 for r in requests), "checkpoint load")
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.shards[index.fqn].views[index.index]

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self.progress.update(math.prod(read_item.lengths) * tensor.element_size())


class _BytesLoadPlanner(DefaultLoadPlanner):
    """Reads byte objects as raw bytes: DCP's default would torch.load (unpickle) them."""

    def __init__(self, keys: list[str]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.keys, self.raw = keys, {}

    def create_local_plan(self) -> LoadPlan:
        none = torch.Size((0,))
        return LoadPlan([ReadItem(LoadItemType.BYTE_IO, MetadataIndex(k), none, MetadataIndex(k), none, none)
                         for k in self.keys])

    def load_bytes(self, read_item: ReadItem, value) -> None:
        self.raw[read_item.dest_index.fqn] = value.getvalue()


def check_stored_shape(path: str, fqn: str, md, global_shape) -> None:
    """The checkpoint in `path` holds tensor `fqn` (metadata `md`) at `global_shape`, or one error."""
    if md is None:
        raise CheckpointError(
            f"{path}: the checkpoint has no tensor {fqn!r}; it was saved from a different model (or without "
            f"this state); load a matching checkpoint, or pass --no-load-optim / --finetune")
    if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(global_shape):
        stored = tuple(md.size) if isinstance(md, TensorStorageMetadata) else type(md).__name__
        raise CheckpointError(
            f"{path}: checkpoint tensor {fqn!r} has global shape {stored} but this model needs "
            f"{tuple(global_shape)}: the checkpoint was saved from a model of another shape (any layout "
            f"and padded vocabulary load, other sizes must match)")


# ---- safe metadata -----------------------------------------------------------------------------
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
# A dict lookup from a layout's name, and the checkpoint path DCP records in StorageMeta.
_SAFE_CALLABLES = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                   ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses/enums and torch's Size and dtype-like constants only."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

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
        raise CheckpointError(f"{self.path} refers to {module}.{name}, which a DCP metadata file never "
                              f"holds; refusing to unpickle it (the file is corrupt or unsafe): restore it "
                              f"from the original run")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of the checkpoint directory `path` (keys, global shapes, chunks)."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} has no .metadata (the index of its DCP tensor files): the save did "
                              f"not finish or the copy is partial; copy the whole directory, or load an "
                              f"earlier iteration")
    try:
        return SafeFileSystemReader(path).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign pickle fails in many ways
        raise CheckpointError(f"{path}/.metadata is truncated or corrupt ({type(e).__name__}: {e}); restore "
                              f"it from the original run, or load an earlier iteration") from None


def check_shards(shards: dict[str, Shard], stored: dict, path: str) -> None:
    """Raise one CheckpointError (before any collective) if a key is missing from the metadata
    `stored` of the checkpoint in `path` (read_metadata(path).state_dict_metadata) or shaped otherwise."""
    for fqn, shard in shards.items():
        if shard.boxes:
            check_stored_shape(path, fqn, stored.get(fqn), shard.global_shape)


@contextlib.contextmanager
def _maybe_without_process_group():
    """DCP warns when it runs in one process without torch.distributed; that is what tools do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield not dist.is_initialized()


def check_files(path: str, metadata: Metadata) -> None:
    """Refuse a partial checkpoint (a rank's file missing or cut short) before any rank starts reading."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    files = sorted(needed)
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise CheckpointError(
            f"{path} is incomplete: its .metadata lists {len(files)} data files but {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''} are missing (a save that did not finish, or a partial "
            f"copy); copy the whole directory, or load an earlier iteration")
    for name in files:
        size = os.path.getsize(os.path.join(path, name))
        if size < needed[name]:
            raise CheckpointError(
                f"{os.path.join(path, name)}: {size} bytes, but .metadata places tensors up to byte "
                f"{needed[name]}; the file is truncated (a partial copy or a full disk): copy it again, or "
                f"load an earlier iteration")


def save_shards(shards: dict[str, Shard], path: str, objects: dict | None = None) -> None:
    """Collective: write every rank's boxes into `path`, and `objects` (key -> picklable plain
    data, torch.saved as DCP bytes; write each from one rank). Also works in a process without
    torch.distributed, e.g. a conversion tool."""
    planner = _ShardSavePlanner(shards, objects)
    try:
        with _maybe_without_process_group() as no_dist:
            dcp.save(_dcp_state_dict(shards), storage_writer=FileSystemWriter(path, thread_count=1),
                     planner=planner, no_dist=no_dist)
    finally:
        if hasattr(planner, "progress"):
            planner.progress.close()


def read_objects(path: str, keys: list[str]) -> dict[str, bytes]:
    """The raw (still pickled) bytes of byte objects `keys`; this rank alone, no collective."""
    planner = _BytesLoadPlanner(keys)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({}, storage_reader=SafeFileSystemReader(path), planner=planner, no_dist=True)
    return planner.raw


def load_shards(shards: dict[str, Shard], path: str) -> None:
    """Collective: fill every Shard's views in place from the checkpoint in `path` (also works
    in a process without torch.distributed)."""
    planner = _ShardLoadPlanner(shards, path)
    try:
        with _maybe_without_process_group() as no_dist:
            dcp.load(_dcp_state_dict(shards), storage_reader=SafeFileSystemReader(path),
                     planner=planner, no_dist=no_dist)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP gathers every rank's failure into one exception
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: reading its tensors failed ({type(e).__name__}: {first}); the "
                              f"checkpoint is damaged: load an older one") from None
    finally:
        if hasattr(planner, "progress"):
            planner.progress.close()
