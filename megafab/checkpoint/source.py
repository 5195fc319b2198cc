"""A checkpoint to load, whatever its format: what load_checkpoint asks of it.

Each format (formats.py) opens as a CheckpointSource: the global tensors it stores under megafab's
keys and shapes (layout.py), the run's args for the model check, the counters a resumed run
continues from, whether its optimizer state can be read, and where this rank's RNG streams are.
`read` fills megafab-keyed Shards in place; the format's own keys, stacking and files stay inside.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from megafab.checkpoint.directory import COMMON, FORMAT_VERSION
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import Shard
from megafab.layout import DEFAULT_ORDER

RNG_DIR = "rng"


def rng_file(path: str, rank: int) -> str:
    return os.path.join(path, RNG_DIR, f"rank_{rank:05d}.pt")


@dataclass
class Counters:
    """Where a resumed run continues: the loop's counters, the LR schedule (megafab's field names;
    a Megatron checkpoint sets those it records), the optimizer's step count and loss scaler."""

    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    scheduler: dict = field(default_factory=dict)
    optimizer_iteration: int = 0
    grad_scaler: dict | None = None
    num_floating_point_operations_so_far: float = 0.0


@dataclass
class CheckpointSource:
    """See the module docstring. counters None: the checkpoint holds weights only (--finetune)."""

    format: str
    path: str
    stored: dict
    saved_args: dict | None
    saved_vocab_size: int | None
    counters: Counters | None
    has_optimizer: bool
    optimizer_problem: str | None = None
    rng_layout: dict | None = None  # megafab-written: the layout whose per-rank RNG files it holds
    rng_missing: str | None = None  # why there are none to restore (None: saved with --no-save-rng)

    def read(self, shards: dict[str, Shard]) -> None:
        """Collective: fill the Shards' views (megafab keys) from the checkpoint."""
        raise NotImplementedError

    def rng_path(self, rank: int, layout: dict) -> tuple[str | None, str | None]:
        """(this rank's RNG file, None) or (None, why the RNG states are not restored, or None when
        the run saved none)."""
        if self.rng_layout is None:
            return None, self.rng_missing
        if self.rng_layout != layout:
            return None, (f"checkpoint layout {self.rng_layout} differs from this run's {layout}; RNG states "
                          f"are per rank, so they are not restored (dropout masks will differ)")
        return rng_file(self.path, rank), None


def run_layout(tp: int, pp: int, dp: int, vpp: int = 1, cp: int = 1, ep: int = 1,
               etp: int | None = None, order: str = DEFAULT_ORDER) -> dict:
    """The layout a checkpoint records (the RNG files are per rank of it). CP, the expert grid and
    the rank order (--use-tp-pp-dp-mapping) are named only where they differ from a dense run's, so
    dense checkpoints keep their record."""
    layout = {"world_size": tp * pp * dp * cp, "tp": tp, "pp": pp, "dp": dp, "vpp": vpp}
    if cp > 1:
        layout["cp"] = cp
    if ep > 1:
        layout["ep"] = ep
    if etp is not None and etp != tp:
        layout["etp"] = etp
    if order != DEFAULT_ORDER:
        layout["order"] = order
    return layout


@dataclass
class CommonRecord:
    """megafab's common data of a checkpoint, whoever writes it (a training run, megafab-convert):
    stored as a JSON-able dict (to_dict) under `megafab` in torch_dist's common.pt and in legacy rank
    files (common.json in megafab's earlier format); read back by counters_from_common. counters None:
    weights only (a converted checkpoint; load it with --finetune)."""

    iteration: int
    layout: dict
    config: dict  # Config.to_flat()
    counters: Counters | None = None
    has_optimizer: bool = False
    has_rng: bool = False

    def to_dict(self) -> dict:
        c = self.counters or Counters(self.iteration, 0)
        return {"format_version": FORMAT_VERSION, "iteration": self.iteration,
                "consumed_train_samples": c.consumed_train_samples,
                "consumed_valid_samples": c.consumed_valid_samples,
                "skipped_iterations": c.skipped_iterations, "nan_iterations": c.nan_iterations,
                "scheduler": c.scheduler if self.counters is not None else None,
                "optimizer_iteration": c.optimizer_iteration, "grad_scaler": c.grad_scaler,
                "num_floating_point_operations_so_far": c.num_floating_point_operations_so_far,
                "has_optimizer": self.has_optimizer, "has_rng": self.has_rng, "layout": self.layout,
                "config": self.config}

    @property
    def num_floating_point_operations_so_far(self) -> float:
        """Megatron's top-level common entry (0 for a weights-only checkpoint)."""
        return self.counters.num_floating_point_operations_so_far if self.counters is not None else 0.0


def counters_from_common(common: dict) -> Counters | None:
    """The counters of megafab's common state (common.json, or the `megafab` entry of a torch_dist
    common.pt); None for a weights-only checkpoint."""
    if common.get("scheduler") is None:
        return None
    return Counters(common["iteration"], common["consumed_train_samples"],
                    common.get("consumed_valid_samples", 0),  # saved since issue 18
                    common["skipped_iterations"], common["nan_iterations"], common["scheduler"],
                    common["optimizer_iteration"], common["grad_scaler"],
                    common.get("num_floating_point_operations_so_far", 0.0))  # saved since --log-progress


def read_json_object(file: str) -> dict:
    """A checkpoint's JSON file holding one object (common.json, metadata.json), or its problem named."""
    try:
        with open(file) as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e}); the save did not finish or the file is "
                              f"damaged: restore it, or load an earlier iteration") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: holds a JSON {type(value).__name__}, not an object; the file is "
                              f"damaged: restore it, or load an earlier iteration")
    return value


def read_common_json(path: str) -> dict:
    """megafab's common.json of the checkpoint directory `path`, checked."""
    file = os.path.join(path, COMMON)
    common = read_json_object(file)
    missing = [k for k in ("iteration", "consumed_train_samples", "has_optimizer", "has_rng", "layout",
                           "config") if k not in common]
    if missing:
        raise CheckpointError(f"{file}: has no {', '.join(missing)}; the file is damaged: load an earlier "
                              f"iteration")
    return common


class MegafabSource(CheckpointSource):
    """megafab's earlier format: common.json + DCP files under model.* / optim.* keys."""

    def __init__(self, path: str):
        # deferred: torch.distributed.checkpoint costs seconds to import; only saves and loads pay it
        from megafab.checkpoint import dcp_io

        common = read_common_json(path)
        metadata = dcp_io.read_metadata(path)
        dcp_io.check_files(path, metadata)
        super().__init__("megafab", path, metadata.state_dict_metadata, common["config"],
                         common["config"].get("vocab_size"), counters_from_common(common),
                         common["has_optimizer"],
                         rng_layout=common["layout"] if common["has_rng"] else None)

    def read(self, shards: dict[str, Shard]) -> None:
        # deferred: torch.distributed.checkpoint costs seconds to import; only saves and loads pay it
        from megafab.checkpoint import dcp_io

        dcp_io.load_shards(shards, self.path)
