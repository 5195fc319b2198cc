"""The parallel grid as sizes of named axes: the one home of every grid derivation (DP, expert-DP,
ETP's default), every grid rule and every rank list. Pure arithmetic, no torch: the config's
derivations, the rules, the planner and megafab.distributed.topology's process groups read it.

Two grids fold over the same ranks, as megatron-core's two RankGenerators (MoE parallel folding),
both in one order string, TP fastest: Megatron's default 'tp-cp-ep-dp-pp', or with
--use-tp-pp-dp-mapping 'tp-cp-ep-pp-dp' (pp before dp in both grids). The default:

    dense  (attention, dense MLP, embeddings): tp - cp - dp - pp   (ep = 1)
        global_rank = tp + TP * (cp + CP * (dp + DP * pp)),        DP  = world / (TP * CP * PP)
    expert (routed experts):                   etp - ep - edp - pp (cp = 1)
        global_rank = etp + ETP * (ep + EP * (edp + EDP * pp)),    EDP = world / (ETP * EP * PP)

ETP defaults to TP (Megatron). "pp" is the one shared axis, so both grids' pipeline groups must be
the same ranks: pp last does it; under tp-pp-dp only equal DPs do (Megatron asserts it). A group is
named by the axes its ranks vary over, the other coordinates of its grid fixed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from megafab.errors import MegafabError

DEFAULT_ORDER = "tp-cp-ep-dp-pp"  # Megatron's rank order
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"  # --use-tp-pp-dp-mapping


def grids_of(order: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(dense, expert) axes of an order string: the dense grid without ep, the expert grid without cp
    and with tp, dp read as etp, edp."""
    tokens = order.split("-")
    return (tuple(t for t in tokens if t != "ep"),
            tuple({"tp": "etp", "dp": "edp"}.get(t, t) for t in tokens if t != "cp"))


DENSE, EXPERT = grids_of(DEFAULT_ORDER)  # ("tp", "cp", "dp", "pp"), ("etp", "ep", "edp", "pp")


def rank_order(use_tp_pp_dp_mapping: bool) -> str:
    return TP_PP_DP_ORDER if use_tp_pp_dp_mapping else DEFAULT_ORDER
ORDER = ("tp", "cp", "etp", "ep", "dp", "edp", "pp")  # every axis; names list axes in this order
FLAGS = {"tp": "tensor-model-parallel-size", "cp": "context-parallel-size",
         "pp": "pipeline-model-parallel-size", "ep": "expert-model-parallel-size",
         "etp": "expert-tensor-parallel-size"}


class LayoutError(MegafabError):
    """A parallel layout that cannot be built; the message names every problem."""


def expert_tensor_parallel_size(tp: int, etp: int | None) -> int:
    """ETP: --expert-tensor-parallel-size, or TP where it is unset (Megatron's default)."""
    return tp if etp is None else etp


def _replicas(world_size: int | None, *sizes: int) -> int | None:
    product = 1
    for size in sizes:
        if size < 1:
            return None
        product *= size
    if world_size is None or world_size % product:
        return None
    return world_size // product


def data_parallel_size(world_size: int | None, tp: int, cp: int, pp: int) -> int | None:
    """DP = world / (TP x CP x PP); None where the sizes do not divide the world (a rule says so)."""
    return _replicas(world_size, tp, cp, pp)


def expert_data_parallel_size(world_size: int | None, tp: int, pp: int, ep: int = 1,
                              etp: int | None = None) -> int | None:
    """Expert-DP = world / (ETP x EP x PP), the ranks holding the same experts' shards (CP folded
    into it); None where the sizes do not divide the world."""
    return _replicas(world_size, expert_tensor_parallel_size(tp, etp), ep, pp)


def layout_problems(world_size: int | None, tp: int, pp: int, cp: int = 1, ep: int = 1,
                    etp: int | None = None, order: str = DEFAULT_ORDER) -> list[str]:
    """Every broken grid rule: sizes at least 1, TP x CP x PP and ETP x EP x PP dividing the
    world (etp None: ETP = TP; world_size None: a world not known yet, only the sizes checked), and
    under an order without pp last, both grids' DP equal where PP > 1 (Megatron's assert)."""
    problems = []
    sizes = {"tp": tp, "cp": cp, "pp": pp, "ep": ep, "etp": expert_tensor_parallel_size(tp, etp)}
    for axis, value in sizes.items():
        if value < 1 and (axis != "etp" or etp is not None):  # an unset ETP is TP's problem
            problems.append(f"--{FLAGS[axis]} is {value}; it must be at least 1")
    if min(sizes.values()) < 1 or world_size is None:
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
    if not problems and not order.endswith("pp") and pp > 1:
        dp, edp = world_size // (tp * cp * pp), world_size // (sizes["etp"] * ep * pp)
        if dp != edp:
            problems.append(
                f"--use-tp-pp-dp-mapping with --{FLAGS['pp']} {pp} needs the expert grid's data-parallel "
                f"size (world / (ETP x EP x PP) = {edp}) to equal the dense grid's (world / (TP x CP x PP) "
                f"= {dp}), or the two grids' pipeline groups differ (Megatron asserts it); drop "
                f"--use-tp-pp-dp-mapping or choose ETP x EP = TP x CP")
    return problems


def in_order(axes) -> tuple[str, ...]:
    return tuple(a for a in ORDER if a in axes)


def group_name(axes) -> str:
    """"tp-pp" for ("pp", "tp"): the axes in the grid's order."""
    return "-".join(in_order(axes))


@dataclass(frozen=True)
class Layout:
    """Sizes of the named axes of a world; every rank list is a pure function of these.
    etp None means ETP = TP (resolved here, so Layout(8, tp=2) == Layout(8, tp=2, etp=2)); order: the
    rank order string both grids follow."""

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    order: str = DEFAULT_ORDER

    def __post_init__(self):
        problems = layout_problems(self.world_size, self.tp, self.pp, self.cp, self.ep, self.etp, self.order)
        if problems:
            raise LayoutError("; ".join(problems))
        object.__setattr__(self, "etp", expert_tensor_parallel_size(self.tp, self.etp))

    @classmethod
    def of(cls, parallel) -> Layout:
        """The layout of a resolved config's parallel section (cfg.parallel)."""
        return cls(parallel.world_size, tp=parallel.tensor_model_parallel_size,
                   cp=parallel.context_parallel_size, pp=parallel.pipeline_model_parallel_size,
                   ep=parallel.expert_model_parallel_size, etp=parallel.expert_tensor_parallel_size,
                   order=rank_order(parallel.use_tp_pp_dp_mapping))

    @property
    def dense(self) -> tuple[str, ...]:
        return grids_of(self.order)[0]

    @property
    def expert(self) -> tuple[str, ...]:
        return grids_of(self.order)[1]

    @property
    def dp(self) -> int:
        return data_parallel_size(self.world_size, self.tp, self.cp, self.pp)

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks holding the same experts' shards."""
        return expert_data_parallel_size(self.world_size, self.tp, self.pp, self.ep, self.etp)

    def size(self, axis: str) -> int:
        if axis not in ORDER:
            raise LayoutError(f"unknown parallel axis {axis!r}; the axes are {'-'.join(self.dense)} "
                              f"(dense) and {'-'.join(self.expert)} (expert)")
        return getattr(self, axis)

    def grid(self, axes) -> tuple[str, ...]:
        """The grid (self.dense or self.expert) that `axes` name; axes of size 1 belong to either."""
        moving = {a for a in axes if self.size(a) > 1}
        dense, expert = moving - set(EXPERT), moving - set(DENSE)
        if dense and expert:
            raise LayoutError(
                f"no group spans {'-'.join(in_order(axes))}: {', '.join(in_order(dense))} "
                f"belong to the dense grid ({'-'.join(self.dense)}) and {', '.join(in_order(expert))} "
                f"to the expert grid ({'-'.join(self.expert)})")
        return self.expert if expert else self.dense

    def coords(self, rank: int) -> dict[str, int]:
        """{axis: coordinate} of a global rank, on both grids ("pp" is the same on each)."""
        out = {}
        for grid in (self.dense, self.expert):
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
        grids = [g for g in (self.dense, self.expert) if named & set(g)] or [self.dense]
        ranks = {self._rank(g, coords) for g in grids}
        if len(ranks) != 1:
            raise LayoutError(f"coordinates {coords} name ranks {sorted(ranks)} on the dense "
                              f"and the expert grid")
        return ranks.pop()

    def grid_groups(self, grid, axes) -> list[list[int]]:
        """Every group of `grid` spanning `axes` (see groups)."""
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
        return self.grid_groups(self.grid(axes), axes)

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each PP group (the tied word-embedding copies)."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]
