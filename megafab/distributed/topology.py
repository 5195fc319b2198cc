"""The process groups of one rank over the parallel grid (megafab.layout: the axes, their sizes,
every rank list; the launch environment, device and backend come from megafab.run.launch).

A group is named by the axes its ranks vary over, all other coordinates of its grid fixed: "dp"
(pure data parallel), "cp", "dp-cp" (what gradients are averaged over and the distributed optimizer
shards over, as Megatron's), "tp-pp" (model parallel: grad-norm and overflow reductions), "tp-dp-cp"
(FP8 amax reductions), "tp-cp" (the MoE router's token gather), and on the expert grid "ep" (token
dispatch), "etp", "etp-ep", "etp-ep-pp" (grad norms of expert params) and "edp" (expert grads and
their optimizer shards). Axes of size 1 change no group (group("ep", "dp") at EP 1 is group("dp"));
a name spanning axes of both grids, each of size > 1, is refused. `topo.group(*axes)` is the one
accessor, in any axis order; the tied-embedding group (first and last stage) is
`topo.embedding_group()`. Example, 16 ranks with TP=2, PP=4 (DP=2): TP [0,1] [2,3] ...; DP [0,2]
[1,3] [4,6] ...; PP [0,4,8,12] [1,5,9,13] ...; embedding [0,12] .... One Topology per process,
made once at initialize and passed to whatever needs groups.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megafab.layout import (
    DEFAULT_ORDER,
    DENSE,
    EXPERT,
    FLAGS,
    ORDER,
    Layout,
    LayoutError,
    group_name,
    layout_problems,
)
from megafab.run.launch import pick_device_and_backend, read_launch_env, rendezvous_store

__all__ = ["DENSE", "EXPERT", "FLAGS", "ORDER", "GROUP_AXES", "EMBEDDING", "Layout", "LayoutError",
           "TopologyError", "Topology", "all_group_ranks", "build_topology", "group_name", "initialize",
           "layout_problems"]
TopologyError = LayoutError  # the layout's error under the name the runtime's callers know

# The axis combinations whose groups every rank builds at initialize (each one has a reader).
GROUP_AXES = (("tp",), ("cp",), ("dp",), ("pp",), ("tp", "pp"), ("dp", "cp"), ("tp", "dp", "cp"),
              ("tp", "cp"), ("ep",), ("etp",), ("etp", "ep"), ("etp", "ep", "pp"), ("edp",))
EMBEDDING = "embedding"  # first and last stage of each pipeline: the tied word-embedding copies


def all_group_ranks(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
                    etp: int | None = None, order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """Every group of every built kind (GROUP_AXES by group_name, plus "embedding") as lists of
    global ranks.

    Pure function of the layout, so each rank can build all groups in the same order
    (torch.distributed requires every rank to take part in every new_group call).
    """
    layout = Layout(world_size, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
    assert layout.grid_groups(layout.dense, ("pp",)) == layout.grid_groups(layout.expert, ("pp",)), \
        "the dense and expert grids must share their pipeline groups (as Megatron asserts)"
    out = {group_name(axes): layout.groups(*axes) for axes in GROUP_AXES}
    out[EMBEDDING] = layout.embedding_groups()
    return out


def _axes_key(layout: Layout, axes) -> tuple[str, ...]:
    """Axes of size 1 change no group: ("dp", "cp") at CP 1 is the DP group."""
    layout.grid(axes)  # refuses unknown names and names spanning both grids
    return tuple(a for a in ORDER if a in axes and layout.size(a) > 1)


@dataclass
class Topology:
    """This process's place in the dense (tp-cp-dp-pp) and expert (etp-ep-edp-pp) grids and the
    groups it talks to."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    vpp: int
    device: torch.device
    backend: str
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    """This rank's group of each built kind by group_name ("tp", "tp-pp", "embedding", ...)."""
    cp: int = 1
    groups_by_axes: dict[tuple[str, ...], object] = field(default_factory=dict)
    embedding: object = None
    ep: int = 1
    etp: int | None = None  # None: ETP = TP
    order: str = DEFAULT_ORDER  # the rank order (megafab.layout)

    @functools.cached_property
    def layout(self) -> Layout:
        return Layout(self.world_size, tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep,
                      etp=self.etp, order=self.order)

    @functools.cached_property
    def _coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    def size(self, axis: str) -> int:
        """The size of an axis of either grid: size("ep"), size("edp"), ..."""
        return self.layout.size(axis)

    def coord(self, axis: str) -> int:
        """This rank's coordinate on an axis of either grid."""
        self.layout.size(axis)
        return self._coords[axis]

    rank_in = coord  # topo.rank_in("ep"): the name the MoE code reads

    @property
    def tp_rank(self) -> int:
        return self.coord("tp")

    @property
    def cp_rank(self) -> int:
        return self.coord("cp")

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def pp_rank(self) -> int:
        return self.coord("pp")

    def group(self, *axes: str):
        """The process group spanning `axes` (e.g. group("dp", "cp"), group("etp", "ep")) that
        holds this rank."""
        key = _axes_key(self.layout, axes)
        if key not in self.groups_by_axes:
            built = sorted({"-".join(k) or "(single rank)" for k in self.groups_by_axes})
            raise TopologyError(f"no process group spans {'-'.join(axes)} in this layout; built: "
                                f"{', '.join(built)}")
        return self.groups_by_axes[key]

    def embedding_group(self):
        """The first and last pipeline stage holding this rank (None off those stages)."""
        return self.embedding

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
        return self.rank in self.group_ranks.get(EMBEDDING, [])


def build_topology(tp: int = 1, pp: int = 1, vpp: int = 1, device: torch.device | None = None,
                   backend: str | None = None, cp: int = 1,
                   timeout: datetime.timedelta | None = None, ep: int = 1,
                   etp: int | None = None, order: str = DEFAULT_ORDER) -> Topology:
    """Make the groups of an already initialized default process group.

    Groups are made with new_group for every layout group, in the same order on every rank
    (gloo on CPU cannot use split_group, and DeviceMesh's CPU path would need it); kinds whose
    rank lists coincide (dp and dp-cp at CP 1) share one process group. timeout: of every
    group's collectives (torch's default for a new group is 30 minutes, not the world's).
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize torch.distributed first (megafab.distributed.initialize)")
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = Layout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
    layouts = all_group_ranks(world, tp, pp, cp, ep, etp, order)
    if device is None:
        device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device(
            "cuda", torch.cuda.current_device())
    topo = Topology(rank=rank, world_size=world, tp=tp, pp=pp, dp=layout.dp, vpp=vpp, device=device,
                    backend=backend or dist.get_backend(), cp=cp, ep=ep, etp=layout.etp, order=order)
    made: dict[tuple[int, ...], object] = {}
    for kind, groups in layouts.items():
        for ranks in groups:
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.group.WORLD if len(ranks) == world \
                    else dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                topo.group_ranks[kind] = ranks
                if kind == EMBEDDING:
                    topo.embedding = made[key]
                else:
                    topo.groups_by_axes[_axes_key(layout, kind.split("-"))] = made[key]
    return topo


def initialize(tp: int = 1, pp: int = 1, vpp: int = 1, backend: str | None = None,
               timeout_minutes: float = 10.0, env: dict[str, str] | None = None,
               cp: int = 1, ep: int = 1, etp: int | None = None, order: str = DEFAULT_ORDER) -> Topology:
    """Start the default process group from the launcher's environment and build the grid.

    Layout problems are raised before any process group exists.
    """
    launch = read_launch_env(env)
    problems = layout_problems(launch.world_size, tp, pp, cp, ep, etp, order)
    if problems:
        raise TopologyError("; ".join(problems))
    device, backend = pick_device_and_backend(launch.local_rank, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend=backend, store=rendezvous_store(launch, timeout, env),
                                rank=launch.rank, world_size=launch.world_size, timeout=timeout)
    return build_topology(tp, pp, vpp, device, backend, cp,
                          datetime.timedelta(minutes=timeout_minutes), ep=ep, etp=etp, order=order)
