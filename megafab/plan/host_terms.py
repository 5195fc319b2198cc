"""A machine's host as the step-time model sees it: host_model() is step_time's one view of it.
A GPU node's profile has no CPU terms (DeviceHost: the host runs ahead of the kernels); a measured
CPU profile's (megafab.calibrate measures them) are priced by CpuHost:

  host overheads   Python work the kernels' times leave out (Machine.host_overheads, per sharding):
                   per micro-batch in each model chunk (VPP calls every chunk's forward and
                   backward), per layer, per fully (or selectively) recomputed layer, per parameter
                   tensor the rank's optimizer steps (optimizer_tensors.param_tensors), per step.
  shared cores     ranks beyond the cores (Machine.compute_slots) compute in turn, and a busy core
                   runs slower (busy_slowdown): sharing() stretches kernels, host work and the
                   optimizer; collectives are measured in a step already and are not stretched.
  shared pipeline  with PP the schedule runs through time, each pass stretched by the ranks
                   computing then (schedule.shared_pipeline_time).
  in-step entries  collectives fitted to megafab's own steps (megafab.calibrate.steps): "n@world",
                   ":step" for the once-a-step data-parallel reductions, ":fsdp" for FSDP2's calls.
"""

from __future__ import annotations

import itertools

from megafab.plan.optimizer_tensors import param_tensors, sharding_name
from megafab.plan.schedule import PipelineTime, StagePass, pipeline_time, shared_pipeline_time

HOST_TERMS = ("step_s", "micro_batch_s", "layer_micro_batch_s", "param_tensor_s",
              "recomputed_layer_micro_batch_s", "selective_layer_micro_batch_s")
STEP_SUFFIX = ":step"  # a CPU profile's entry for the data-parallel reduction issued once a step
FSDP_SUFFIX = ":fsdp"  # and for FSDP2's per-group gathers and reduce-scatters


def measured_key(n: int, world: int, suffix: str = "") -> str:
    """A CPU profile's in-step collectives key for a group of n in a job of `world` ranks."""
    return f"{n}@{world}{suffix}"


def in_step_entry(table: dict, n: int, world: int, suffix: str = ""):
    """[alpha, busbw] of a group of n as a step of a `world`-rank job sees it: the suffix's entry,
    else the per-layer one; None where the profile has neither."""
    for key in (measured_key(n, world, suffix), measured_key(n, world)):
        if key in table:
            return table[key]
    return None


def sharing(machine, devices_on_node: int) -> float:
    """How much longer a device's compute takes than alone: the devices sharing one compute slot
    (> 1 when a CPU runs more ranks than it has cores), times the busy slowdown of the slots in use
    (none with one, all of it with every slot)."""
    if not machine.compute_slots:
        return 1.0
    busy = (min(devices_on_node, machine.compute_slots) - 1) / max(machine.compute_slots - 1, 1)
    return max(1.0, devices_on_node / machine.compute_slots) * (1.0 + (machine.busy_slowdown - 1.0) * busy)


def host_overhead(machine, sharding: str) -> dict[str, float]:
    """host_overheads' terms for a sharding ("none", "distributed_optimizer", "fsdp2"; DDP's where the
    profile has no entry for it), 0 where it has none."""
    terms = machine.host_overheads.get(sharding) or machine.host_overheads.get("none") or {}
    return {k: terms.get(k, 0.0) for k in HOST_TERMS}


def _schedule(cfg) -> tuple[int, int]:
    return cfg.training.num_micro_batches or 1, cfg.parallel.virtual_pipeline_model_parallel_size or 1


class DeviceHost:
    """A GPU's host: it runs ahead of the kernels (their launch cost is Machine.kernel_overhead_s),
    so a step pays only its host sync (iteration_overhead_s); each rank has its device to itself
    and the schedule takes schedule.pipeline_time."""
    scale = 1.0  # compute stretch: none

    def __init__(self, cfg, machine, layers):
        self.cfg = cfg
        self.micro_batch = [0.0] * len(layers)  # host seconds per micro-batch on each stage
        self.step = machine.iteration_overhead_s  # host seconds per step

    def pipeline(self, seconds, passes, fsdp_mb, p2p) -> PipelineTime:
        """The schedule's time: seconds[i] stage i's micro-batch (passes, fsdp_mb: for CpuHost)."""
        return pipeline_time(seconds, *_schedule(self.cfg), p2p)


class CpuHost:
    """A profile with CPU terms (see the module docstring). layers: each stage's chunks' layers as
    (index, recomputed), step_time's stage layout."""

    def __init__(self, cfg, machine, layers):
        self.cfg, self.machine = cfg, machine
        self.ranks_on_node = min(cfg.parallel.world_size, machine.gpus_per_node)
        self.scale = sharing(machine, self.ranks_on_node)
        self.alone, step = _host_seconds(cfg, machine, layers)
        self.micro_batch = [self.scale * h for h in self.alone]
        self.step = self.scale * step

    def pipeline(self, seconds, passes, fsdp_mb, p2p) -> PipelineTime:
        """On shared cores with PP, the schedule run through time: each stage's kernels (passes:
        unstretched (forward, backward)) and host work are compute, split between forward and
        backward as its kernels are; its collectives and FSDP2's exposed unit work are not."""
        pp = self.cfg.parallel.pipeline_model_parallel_size
        if not (self.machine.compute_slots and pp > 1):
            return pipeline_time(seconds, *_schedule(self.cfg), p2p)
        forward, backward = [], []
        for (f, b), g, h in zip(passes, fsdp_mb, self.alone):
            share_f = f.compute / (f.compute + b.compute) if f.compute + b.compute else 0.5
            forward.append(StagePass(f.compute + share_f * h, f.comm + share_f * g))
            backward.append(StagePass(b.compute + (1 - share_f) * h, b.comm + (1 - share_f) * g))
        ranks_per_stage = self.ranks_on_node // pp
        return shared_pipeline_time(forward, backward, *_schedule(self.cfg), p2p,
                                    lambda busy: sharing(self.machine, ranks_per_stage * busy),
                                    self.cfg.parallel.microbatch_group_size_per_vp_stage)


def _host_seconds(cfg, machine, layers) -> tuple[list[float], float]:
    """(each stage's host overhead per micro-batch, the step's host overhead on its slowest rank),
    unstretched: see the module docstring."""
    terms = host_overhead(machine, sharding_name(cfg))
    selective = terms["selective_layer_micro_batch_s"] \
        if cfg.model.recompute_granularity == "selective" else 0.0
    per_mb = []
    for chunks in layers:
        flat = list(itertools.chain.from_iterable(chunks))
        recomputed = sum(1 for _, again in flat if again)
        per_mb.append(terms["micro_batch_s"] * len(chunks)
                      + (terms["layer_micro_batch_s"] + selective) * len(flat)
                      + terms["recomputed_layer_micro_batch_s"] * recomputed)
    tensors = max(param_tensors(cfg, r) for r in range(len(layers))) if terms["param_tensor_s"] else 0
    return per_mb, machine.iteration_overhead_s + terms["step_s"] + terms["param_tensor_s"] * tensors


def host_model(cfg, machine, layers) -> DeviceHost | CpuHost:
    """The machine's host for cfg: CpuHost where the profile has CPU terms (shared cores or host
    overheads), else DeviceHost."""
    cpu = machine.compute_slots or machine.host_overheads
    return (CpuHost if cpu else DeviceHost)(cfg, machine, layers)
