"""The parallel grid as ordered named axes, and the process groups of one rank (the launch
environment, device and backend come from megafab.run.launch).

Two grids fold over the same ranks, as megatron-core's two RankGenerators (MoE parallel folding).
Both use Megatron's default order string 'tp-cp-ep-dp-pp', TP fastest:

    dense  (attention, dense MLP, embeddings): tp - cp - dp - pp   (ep = 1)
        global_rank = tp + TP * (cp + CP * (dp + DP * pp)),        DP  = world / (TP * CP * PP)
    expert (routed experts):                   etp - ep - edp - pp (cp = 1)
        global_rank = etp + ETP * (ep + EP * (edp + EDP * pp)),    EDP = world / (ETP * EP * PP)

ETP defaults to TP. "pp" is the one shared axis: both grids put it last, so their pipeline groups
are the same ranks (asserted, as Megatron does). A group is named by the axes its ranks vary over,
all other coordinates of its grid fixed: "dp" (pure data parallel), "cp", "dp-cp" (what gradients
are averaged over and the distributed optimizer shards over, as Megatron's), "tp-pp" (model
parallel: the grad-norm and overflow reductions), "tp-dp-cp" (FP8 amax reductions), "tp-cp" (the
MoE router's token gather), and on the expert grid "ep" (token dispatch), "etp", "etp-ep", "etp-ep-pp"
(expert model parallel: grad norms of expert params) and "edp" (expert grads and their optimizer
shards). Axes of size 1 change no group, so group("ep", "dp") at EP 1 is group("dp"); a name that
spans axes of both grids, each of size > 1, is refused. `topo.group(*axes)` is the one accessor;
order inside a name does not matter: group("cp", "dp") is group("dp", "cp"). The tied-embedding
group (first and last stage) is not an axis combination: `topo.embedding_group()`.

Example, 16 ranks with TP=2, PP=4 (so DP=2, CP=1):
    TP groups : [0,1] [2,3] [4,5] ... [14,15]
    DP groups : [0,2] [1,3] [4,6] [5,7] ... [13,15]
    PP groups : [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]
    embedding : first and last stage of each PP group, e.g. [0,12]
With TP=2, CP=2, PP=2 on 8 ranks (DP=1): CP groups [0,2] [1,3] [4,6] [5,7]; TP-CP [0,1,2,3] [4..7].
The same 8 ranks with EP=4, ETP=1 (EDP=1): EP groups [0,1,2,3] [4,5,6,7]; with EP=2, ETP=2:
ETP [0,1] [2,3] ..., EP [0,2] [1,3] [4,6] [5,7].

`Layout` holds only sizes and computes every rank list (pure, no process groups). One Topology
per process, made once at initialize and passed to whatever needs groups.
"""

from __future__ import annotations

import datetime
import functools
import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megafab.errors import MegafabError
from megafab.run.launch import pick_device_and_backend, read_launch_env, rendezvous_store

DENSE = ("tp", "cp", "dp", "pp")  # Megatron's 'tp-cp-ep-dp-pp' with ep = 1
EXPERT = ("etp", "ep", "edp", "pp")  # the same order string with tp = ETP, cp = 1
ORDER = ("tp", "cp", "etp", "ep", "dp", "edp", "pp")  # every axis; names list axes in this order
FLAGS = {"tp": "tensor-model-parallel-size", "cp": "context-parallel-size",
         "pp": "pipeline-model-parallel-size", "ep": "expert-model-parallel-size",
         "etp": "expert-tensor-parallel-size"}
# The axis combinations whose groups every rank builds at initialize (each one has a reader).
GROUP_AXES = (("tp",), ("cp",), ("dp",), ("pp",), ("tp", "pp"), ("dp", "cp"), ("tp", "dp", "cp"),
              ("tp", "cp"), ("ep",), ("etp",), ("etp", "ep"), ("etp", "ep", "pp"), ("edp",))
EMBEDDING = "embedding"  # first and last stage of each pipeline: the tied word-embedding copies


class TopologyError(MegafabError):
    """A parallel layout that cannot be built; the message names every problem."""


def layout_problems(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
                    etp: int | None = None) -> list[str]:
    """Every broken grid rule: sizes at least 1, TP x CP x PP and ETP x EP x PP dividing the
    world (etp None: ETP = TP)."""
    problems = []
    sizes = {"tp": tp, "cp": cp, "pp": pp, "ep": ep, "etp": tp if etp is None else etp}
    for axis, value in sizes.items():
        if value < 1 and (axis != "etp" or etp is not None):  # an unset ETP is TP's problem
            problems.append(f"--{FLAGS[axis]} is {value}; it must be at least 1")
    if min(sizes.values()) < 1:
        return problems
    grids = [("tp", "cp", "pp"), ("etp", "ep", "pp")]
    if sizes["etp"] == tp and ep == 1:
        grids.pop()  # the expert grid is then a coarsening of the dense one
    for axes in grids:
        product = sizes[axes[0]] * sizes[axes[1]] * sizes[axes[2]]
        if world_size % product:
            shown = [a for a in axes if a in ("tp", "pp", "etp", "ep") or sizes[a] > 1]
            names = " x ".join(f"--{FLAGS[a]} {sizes[a]}" for a in shown)
            if axes[0] == "etp" and etp is None:
                names = names.replace(f"--{FLAGS['etp']} {tp}", f"--{FLAGS['etp']} {tp} (= TP)")
            grid = "the expert grid " if axes[0] == "etp" else ""
            problems.append(
                f"world size {world_size} is not divisible by {grid}{names} = {product}; launch a "
                f"multiple of {product} processes or choose sizes whose product divides "
                f"{world_size}")
    return problems


def _in_order(axes) -> tuple[str, ...]:
    return tuple(a for a in ORDER if a in axes)


@dataclass(frozen=True)
class Layout:
    """Sizes of the named axes of a world; every rank list is a pure function of these.
    etp None means ETP = TP (resolved here, so Layout(8, tp=2) == Layout(8, tp=2, etp=2))."""

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    def __post_init__(self):
        problems = layout_problems(self.world_size, self.tp, self.pp, self.cp, self.ep, self.etp)
        if problems:
            raise TopologyError("; ".join(problems))
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks holding the same experts' shards."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def size(self, axis: str) -> int:
        if axis not in ORDER:
            raise TopologyError(f"unknown parallel axis {axis!r}; the axes are {'-'.join(DENSE)} "
                                f"(dense) and {'-'.join(EXPERT)} (expert)")
        return getattr(self, axis)

    def grid(self, axes) -> tuple[str, ...]:
        """The grid (DENSE or EXPERT) that `axes` name; axes of size 1 belong to either."""
        moving = {a for a in axes if self.size(a) > 1}
        dense, expert = moving - set(EXPERT), moving - set(DENSE)
        if dense and expert:
            raise TopologyError(
                f"no group spans {'-'.join(_in_order(axes))}: {', '.join(_in_order(dense))} "
                f"belong to the dense grid ({'-'.join(DENSE)}) and {', '.join(_in_order(expert))} "
                f"to the expert grid ({'-'.join(EXPERT)})")
        return EXPERT if expert else DENSE

    def coords(self, rank: int) -> dict[str, int]:
        """{axis: coordinate} of a global rank, on both grids ("pp" is the same on each)."""
        out = {}
        for grid in (DENSE, EXPERT):
            rest = rank
            for axis in grid:
                out[axis] = rest % self.size(axis)
                rest //= self.size(axis)
        return out

    def _rank(self, grid, coords) -> int:
        rank = 0
        for axis in reversed(grid):
            rank = rank * self.size(axis) + coords.get(axis, 0)
        return rank

    def rank(self, **coords: int) -> int:
        """Global rank of the given coordinates (missing axes at 0), on the grid they name;
        coordinates of both grids must agree."""
        for axis in coords:
            self.size(axis)
        named = set(coords) - {"pp"}
        grids = [g for g in (DENSE, EXPERT) if named & set(g)] or [DENSE]
        ranks = {self._rank(g, coords) for g in grids}
        if len(ranks) != 1:
            raise TopologyError(f"coordinates {coords} name ranks {sorted(ranks)} on the dense "
                                f"and the expert grid")
        return ranks.pop()

    def _groups(self, grid, axes) -> list[list[int]]:
        spanned = [a for a in grid if a in axes]
        fixed = [a for a in grid if a not in spanned]

        def product(names):  # coordinates, first name fastest
            ranges = [range(self.size(a)) for a in reversed(names)]
            return [dict(zip(reversed(names), c)) for c in itertools.product(*ranges)]

        return [sorted(self._rank(grid, {**outer, **inner}) for inner in product(spanned))
                for outer in product(fixed)]

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group spanning `axes`, as ascending global ranks; groups enumerated over the
        other axes' coordinates of the same grid, first axis of the order fastest (Megatron's
        RankGenerator.get_ranks)."""
        return self._groups(self.grid(axes), axes)

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each PP group (the tied word-embedding copies)."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]


def group_name(axes) -> str:
    """"tp-pp" for ("pp", "tp"): the axes in the grid's order."""
    return "-".join(_in_order(axes))


def all_group_ranks(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
                    etp: int | None = None) -> dict[str, list[list[int]]]:
    """Every group of every built kind (GROUP_AXES by group_name, plus "embedding") as lists of
    global ranks.

    Pure function of the layout, so each rank can build all groups in the same order
    (torch.distributed requires every rank to take part in every new_group call).
    """
    layout = Layout(world_size, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    assert layout._groups(DENSE, ("pp",)) == layout._groups(EXPERT, ("pp",)), \
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

    @functools.cached_property
    def layout(self) -> Layout:
        return Layout(self.world_size, tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep,
                      etp=self.etp)

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
                   etp: int | None = None) -> Topology:
    """Make the groups of an already initialized default process group.

    Groups are made with new_group for every layout group, in the same order on every rank
    (gloo on CPU cannot use split_group, and DeviceMesh's CPU path would need it); kinds whose
    rank lists coincide (dp and dp-cp at CP 1) share one process group. timeout: of every
    group's collectives (torch's default for a new group is 30 minutes, not the world's).
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize torch.distributed first (megafab.distributed.initialize)")
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = Layout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    layouts = all_group_ranks(world, tp, pp, cp, ep, etp)
    if device is None:
        device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device(
            "cuda", torch.cuda.current_device())
    topo = Topology(rank=rank, world_size=world, tp=tp, pp=pp, dp=layout.dp, vpp=vpp, device=device,
                    backend=backend or dist.get_backend(), cp=cp, ep=ep, etp=layout.etp)
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
               cp: int = 1, ep: int = 1, etp: int | None = None) -> Topology:
    """Start the default process group from the launcher's environment and build the grid.

    Layout problems are raised before any process group exists.
    """
    launch = read_launch_env(env)
    problems = layout_problems(launch.world_size, tp, pp, cp, ep, etp)
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
                          datetime.timedelta(minutes=timeout_minutes), ep=ep, etp=etp)
