"""The parallel grid: world -> (tp, dp, pp) ranks and process groups (the launch environment,
device and backend come from megafab.launch).

Rank order is tp-dp-pp with TP fastest, Megatron's default:

    global_rank = tp_rank + TP * (dp_rank + DP * pp_rank)

Example, 16 ranks with TP=2, PP=4 (so DP=2):
    TP groups : [0,1] [2,3] [4,5] ... [14,15]
    DP groups : [0,2] [1,3] [4,6] [5,7] ... [13,15]
    PP groups : [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]
    embedding : first and last stage of each PP group, e.g. [0,12]

One Topology per process, made once at initialize and passed to whatever needs groups.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megafab.errors import MegafabError
from megafab.launch import pick_device_and_backend, read_launch_env, rendezvous_store


class TopologyError(MegafabError):
    """A parallel layout that cannot be built; the message names every problem."""


def grid_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def grid_coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def layout_problems(world_size: int, tp: int, pp: int) -> list[str]:
    problems = []
    for name, value in (("tensor-model-parallel-size", tp), ("pipeline-model-parallel-size", pp)):
        if value < 1:
            problems.append(f"--{name} is {value}; it must be at least 1")
    if tp >= 1 and pp >= 1 and world_size % (tp * pp) != 0:
        problems.append(
            f"world size {world_size} is not divisible by tensor-model-parallel-size {tp} x "
            f"pipeline-model-parallel-size {pp} = {tp * pp}; choose sizes whose product divides "
            f"the number of processes")
    return problems


def all_group_ranks(world_size: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every group of every kind as lists of global ranks, in a fixed order.

    Pure function of the layout, so each rank can build all groups in the same order
    (torch.distributed requires every rank to take part in every new_group call).
    """
    problems = layout_problems(world_size, tp, pp)
    if problems:
        raise TopologyError("; ".join(problems))
    dp = world_size // (tp * pp)
    tp_groups = [[grid_rank(t, d, p, tp, dp) for t in range(tp)] for p in range(pp) for d in range(dp)]
    dp_groups = [[grid_rank(t, d, p, tp, dp) for d in range(dp)] for p in range(pp) for t in range(tp)]
    pp_groups = [[grid_rank(t, d, p, tp, dp) for p in range(pp)] for d in range(dp) for t in range(tp)]
    mp_groups = [[grid_rank(t, d, p, tp, dp) for p in range(pp) for t in range(tp)] for d in range(dp)]
    tp_dp_groups = [[grid_rank(t, d, p, tp, dp) for d in range(dp) for t in range(tp)] for p in range(pp)]
    embedding_groups = [sorted({g[0], g[-1]}) for g in pp_groups]
    return {"tp": tp_groups, "dp": dp_groups, "pp": pp_groups, "mp": mp_groups,
            "tp_dp": tp_dp_groups, "embedding": embedding_groups}


@dataclass
class Topology:
    """This process's place in the (tp, dp, pp) grid and the groups it talks to."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    vpp: int
    device: torch.device
    backend: str
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    mp_group: object = None
    tp_dp_group: object = None
    embedding_group: object = None
    group_ranks: dict[str, list[int]] = field(default_factory=dict)

    @property
    def tp_rank(self) -> int:
        return grid_coords(self.rank, self.tp, self.dp)[0]

    @property
    def dp_rank(self) -> int:
        return grid_coords(self.rank, self.tp, self.dp)[1]

    @property
    def pp_rank(self) -> int:
        return grid_coords(self.rank, self.tp, self.dp)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def next_pp_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around, as Megatron's does)."""
        return self.group_ranks["pp"][(self.pp_rank + 1) % self.pp]

    @property
    def prev_pp_rank(self) -> int:
        return self.group_ranks["pp"][(self.pp_rank - 1) % self.pp]

    @property
    def is_in_embedding_group(self) -> bool:
        return self.rank in self.group_ranks.get("embedding", [])

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} tp {self.tp_rank}/{self.tp} "
                f"dp {self.dp_rank}/{self.dp} pp {self.pp_rank}/{self.pp} on {self.device}")


def build_topology(tp: int = 1, pp: int = 1, vpp: int = 1, device: torch.device | None = None,
                   backend: str | None = None, timeout: datetime.timedelta | None = None) -> Topology:
    """Make the groups of an already initialized default process group.

    Groups are made with new_group for every layout group, in the same order on every rank
    (gloo on CPU cannot use split_group, and DeviceMesh's CPU path would need it). timeout: of
    every group's collectives (torch's default for a new group is 30 minutes, not the world's).
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize torch.distributed first (megafab.distributed.initialize)")
    world, rank = dist.get_world_size(), dist.get_rank()
    layouts = all_group_ranks(world, tp, pp)
    if device is None:
        device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device(
            "cuda", torch.cuda.current_device())
    topo = Topology(rank, world, tp, pp, world // (tp * pp), vpp, device,
                    backend or dist.get_backend())
    for kind, groups in layouts.items():
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timeout) if len(groups) > 1 or len(ranks) != world \
                else dist.group.WORLD
            if rank in ranks:
                setattr(topo, f"{kind}_group", group)
                topo.group_ranks[kind] = ranks
    return topo


def initialize(tp: int = 1, pp: int = 1, vpp: int = 1, backend: str | None = None,
               timeout_minutes: float = 10.0, env: dict[str, str] | None = None) -> Topology:
    """Start the default process group from the launcher's environment and build the grid.

    Layout problems are raised before any process group exists.
    """
    launch = read_launch_env(env)
    problems = layout_problems(launch.world_size, tp, pp)
    if problems:
        raise TopologyError("; ".join(problems))
    device, backend = pick_device_and_backend(launch.local_rank, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend=backend, store=rendezvous_store(launch, timeout, env),
                                rank=launch.rank, world_size=launch.world_size, timeout=timeout)
    return build_topology(tp, pp, vpp, device, backend, datetime.timedelta(minutes=timeout_minutes))
