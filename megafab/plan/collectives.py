"""Alpha-beta times of collectives for a group as the layout places it on the machine.

A group's ranks come from the topology's own rank grids (megafab.distributed.topology.Layout:
Megatron's tp-cp-ep-dp-pp order, TP fastest; MoE experts on the etp-ep-edp-pp grid), and node i
holds ranks [i*G, (i+1)*G) for G GPUs per node. A group inside one node runs on NVLink at the
node's NCCL bus bandwidth; a group across nodes runs its rings through the NICs of its ranks: with
p of its ranks on each node, p NICs carry it (one per GPU, rail-aligned), bus bandwidth
min(intra, p x NIC). Rings are priced as NCCL's own tuning model prices them (_ring_seconds).
A measured profile (megafab.calibrate) has its own alpha per step and bus bandwidth per op and
group size (fitted; one protocol, no base), a CPU profile also in-step entries per kind of call
(host_terms: STEP_SUFFIX, FSDP_SUFFIX).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

from megafab.distributed.topology import Layout
from megafab.layout import DEFAULT_ORDER, rank_order
from megafab.plan.host_terms import FSDP_SUFFIX, STEP_SUFFIX, in_step_entry

__all__ = ["FSDP_SUFFIX", "STEP_SUFFIX", "Placement", "collective_seconds", "group_placement", "p2p_seconds",
           "placement"]


@dataclass(frozen=True)
class Placement:
    size: int
    per_node: int  # most of the group's ranks on one node
    nodes: int
    world: int = field(default=0, compare=False)  # ranks of the whole job (a measured profile's key)


@functools.lru_cache(maxsize=4096)
def placement(world: int, tp: int, cp: int, pp: int, gpus_per_node: int, axes: tuple[str, ...],
              ep: int = 1, etp: int | None = None, order: str = DEFAULT_ORDER) -> Placement:
    """Rank 0's group over `axes`, of the dense grid or of the expert grid (etp, ep, edp)."""
    layout = Layout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
    spans = [range(layout.size(a)) for a in axes]
    ranks = [layout.rank(**dict(zip(axes, c))) for c in itertools.product(*spans)]  # rank 0's group
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // gpus_per_node] = nodes.get(r // gpus_per_node, 0) + 1
    return Placement(len(ranks), max(nodes.values()), len(nodes), world)


def group_placement(cfg, machine, *axes: str) -> Placement:
    """A group of the config's layout; expert axes ("etp", "ep", "edp") on its expert grid."""
    p = cfg.parallel
    return placement(p.world_size, p.tensor_model_parallel_size, p.context_parallel_size,
                     p.pipeline_model_parallel_size, machine.gpus_per_node, tuple(sorted(axes)),
                     p.expert_model_parallel_size, p.expert_tensor_parallel_size,
                     rank_order(p.use_tp_pp_dp_mapping))


_STEPS = {"all_reduce": (2.0, 2), "all_gather": (1.0, 1), "reduce_scatter": (1.0, 1), "all_to_all": (1.0, 1)}


def _link(machine, where: Placement) -> tuple[float, float]:
    """(alpha per step, bus bandwidth) of a group placed so."""
    if where.nodes == 1:
        return machine.intra_latency_s, machine.intra_busbw
    return machine.inter_latency_s, min(machine.intra_busbw, where.per_node * machine.nic_bandwidth)


def _measured(machine, op: str, n: int, world: int, suffix: str = ""):
    """A measured profile's [alpha, busbw] for a group of n: a CPU profile's in-step entry
    (host_terms.in_step_entry), else the loop's of n ranks (the nearest size); None for a built-in
    profile."""
    table = machine.collectives.get(op)
    if not table:
        return None
    entry = in_step_entry(table, n, world, suffix)
    if entry is not None:
        return entry
    sizes = [k for k in table if k.isdigit()]
    if not sizes:
        return None
    return table[min(sizes, key=lambda k: abs(int(k) - n))]


def _ring_seconds(machine, op: str, nbytes: float, where: Placement, busbw: float) -> float:
    """NCCL's ring time of one call, as its tuning model prices it (src/graph/tuning.cc,
    ncclTopoTuneModel / ncclTopoGetAlgoTime): for each protocol a base latency per call, each ring
    step inside a node at its NVLink step latency (at least the network post overhead in a
    multi-node ring) and each step that crosses the network at its network step latency, plus the
    bytes at its share of the bus bandwidth (nccl-tests' factors); NCCL runs the fastest protocol:
    LL for small messages, Simple for large ones, LL128 between. Over n ranks on N nodes, S the full
    (unsharded) message:
        all-reduce          2 (n-1)/n S / (share busbw) + base + (2(n-1) - 2N) intra + 2N inter
        all-gather,
        reduce-scatter      (n-1)/n S / (share busbw) + base + (n-N) intra + (N-1) inter
    On one node N = 1: base + (n-1) intra (all-reduce 2(n-1)). collective_seconds prices an
    all-to-all as (n-1)/n S / busbw + (n-1) alpha (grouped send/recv, no ring: alpha the inter-node
    step latency once the group spans nodes, else the NVLink one); p2p_seconds a send/recv as
    S / link + alpha."""
    n, nodes = where.size, where.nodes
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    across = 0 if nodes == 1 else (2 * nodes if op == "all_reduce" else nodes - 1)
    across = min(across, steps)
    moved = _STEPS[op][0] * (n - 1) / n * nbytes
    simple = [machine.collective_base_latency_s, machine.intra_latency_s, machine.inter_latency_s, 1.0]
    protocols = {"Simple": simple, **machine.ring_protocols}
    best = float("inf")
    for name, (base, nvlink, net, share) in protocols.items():
        if name == "LL" and nodes == 1 and op != "all_reduce":
            share = 1 / 3  # NCCL: LL's 1/4 of the bus is 1/3 for a one-node all-gather/reduce-scatter
        if name == "LL128" and where.per_node < 2:
            share = 0.7  # NCCL: LL128 with one rank per node (sending and receiving on one NIC)
        if nodes > 1:  # a multi-node ring's NVLink steps still post network work (NCCL's netOverhead)
            nvlink = max(nvlink, machine.net_overhead_s * (3 if name == "Simple" else 1))
        best = min(best, moved / (busbw * share) + base + (steps - across) * nvlink + across * net)
    return best


def collective_seconds(machine, op: str, nbytes: float, where: Placement, suffix: str = "") -> float:
    """One collective of nbytes (the full, unsharded size) over the group; suffix STEP_SUFFIX: the
    data-parallel reduction issued once a step, FSDP_SUFFIX: one of FSDP2's (a measured profile may
    price those apart)."""
    n = where.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor, steps = _STEPS[op]
    measured = _measured(machine, op, n, where.world, suffix)
    if measured:
        alpha, busbw = measured
        return factor * (n - 1) / n * nbytes / busbw + steps * (n - 1) * alpha
    alpha, busbw = _link(machine, where)
    if op == "all_to_all":
        return factor * (n - 1) / n * nbytes / busbw + steps * (n - 1) * alpha
    return _ring_seconds(machine, op, nbytes, where, busbw)


def p2p_seconds(machine, nbytes: float, where: Placement) -> float:
    """One send/recv between neighbouring ranks of the group (pipeline stages, a CP ring)."""
    if nbytes <= 0:
        return 0.0
    measured = _measured(machine, "send_recv", 2, where.world)
    if measured:
        return measured[0] + nbytes / measured[1]
    if where.nodes > 1:
        return machine.inter_latency_s + nbytes / machine.nic_bandwidth
    return machine.intra_latency_s + nbytes / machine.intra_busbw
