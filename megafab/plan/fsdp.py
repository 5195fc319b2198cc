"""FSDP2's communication in a training step, as megafab runs it (megafab.distributed.fsdp: torch's
fully_shard with groups per transformer layer -- the layer itself for its norms, its attention
block, its MLP, and an MoE layer's routed experts over expert-DP (plan.params.fsdp_layer_units)
-- and each model chunk the root group holding the rest: embedding, final norm, output layer).

unit() prices one group's gather, reduce-scatter and copies; stage_seconds() what of them a
pipeline stage's compute does not hide, under FSDP2's prefetching (each function's docstring
writes the terms out). Each collective is its own call over the unit's group, so each pays the
ring's latency (megafab.plan.collectives); a measured CPU profile prices FSDP2's calls by their own
fitted entries (collectives.FSDP_SUFFIX).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megafab.plan.collectives import FSDP_SUFFIX, collective_seconds, group_placement
from megafab.plan.state_memory import BYTES, grad_bytes


@dataclass(frozen=True)
class Unit:
    """Seconds of one FSDP2 group's operations (see unit())."""
    gather: float = 0.0
    reduce: float = 0.0
    copy_out: float = 0.0
    copy_in: float = 0.0
    accumulate: float = 0.0


def unit(cfg, machine, dense: int, expert: int = 0) -> Unit:
    """A group of `dense` parameters sharded over DP x CP, or `expert` ones over expert-DP (an MoE
    layer's routed experts); both: the two groups' collectives.

    Per group ("unit") with U parameters on this rank (its TP shard, before DP sharding), e bytes of the
    model dtype and r bytes of the reduction dtype (fp32 by default: megafab's MixedPrecisionPolicy
    reduces in fp32; the model dtype with --grad-reduce-in-bf16):
      all-gather      e U: the fp32 shards are cast to the model dtype before the gather
                      (MixedPrecisionPolicy.param_dtype)
      reduce-scatter  r U
      copy-out        the gathered flat buffer split into the unit's parameters, e U read and e U
                      written on the compute stream once the gather is waited for
                      (torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_all_gather_copy_out)
      copy-in         the unsharded gradients copied into the reduce-scatter's flat input, e U read and
                      r U written on the compute stream, before the reduce-scatter stream waits for it
                      (foreach_reduce)
      accumulate      with gradient accumulation (megafab's no_sync: set_requires_gradient_sync(False))
                      each micro-batch's unsharded gradient added into the accumulator in the
                      reduction dtype, e U + r U read and r U written (FSDPParam.
                      accumulate_unsharded_grad_if_needed)
    Each collective is its own NCCL call over the unit's group, so each pays the ring's latency
    (megafab.plan.collectives): at DP 384 that is milliseconds per group, and a layer has 3 groups
    (4 with routed experts), even the norms' few kilobytes. A measured CPU profile prices FSDP2's calls
    by their own fitted entries (collectives.FSDP_SUFFIX, megafab.calibrate): on gloo each call also
    carries torch's host work around it (foreach_all_gather's copy-in and output allocation,
    foreach_reduce's), ~2x the latency of a TP collective of the same group there.
    """
    e, r = BYTES[cfg.precision.params_dtype_name], grad_bytes(cfg)
    parts = [(dense, group_placement(cfg, machine, "dp", "cp"))]
    if expert:
        parts.append((expert, group_placement(cfg, machine, "edp")))
    def seconds(op: str, width: int) -> float:
        return sum(collective_seconds(machine, op, width * n, where, FSDP_SUFFIX) for n, where in parts)

    gather, reduce = seconds("all_gather", e), seconds("reduce_scatter", r)
    n = dense + expert
    kernels = len([part for part in parts if part[0]])
    return Unit(gather, reduce, copy_out=machine.memory_seconds(2 * e * n, kernels),
                copy_in=machine.memory_seconds((e + r) * n, kernels),
                accumulate=machine.memory_seconds((e + 2 * r) * n, kernels))


def groups(cfg, machine, parts: list[tuple[int, int]]) -> Unit:
    """Several groups taken together (a layer's: planner.fsdp_layer_units), each with its own
    collectives and copies."""
    units = [unit(cfg, machine, dense, expert) for dense, expert in parts if dense or expert]
    return Unit(*(sum(getattr(u, f.name) for u in units) for f in dataclasses.fields(Unit)))


@dataclass(frozen=True)
class Layer:
    unit: Unit
    forward: float  # the layer's forward compute of one micro-batch, seconds
    backward: float  # its backward (with any recomputed forward)


@dataclass(frozen=True)
class StageFsdp:
    per_micro_batch: float  # exposed in every micro-batch of the stage
    reducing: float  # more, inside the backward of the micro-batch that reduce-scatters
    tail: float  # after the stage's last backward


def stage_seconds(cfg, chunks: list[tuple[Unit, list[Layer]]], output_cover: float,
                  accumulating: bool) -> StageFsdp:
    """FSDP2's exposed time on one pipeline stage: chunks, each (root unit, its layers in order);
    output_cover: the output layer's backward (the last stage's last chunk), behind which the
    last layer's backward gather runs; accumulating: more than one micro-batch per step.

    One micro-batch through one chunk of L layers, a layer's groups taken together (their gathers back
    to back on the all-gather stream, as the CPU runs ahead of the device), FSDP2's all-gather and
    reduce-scatter streams both on the group's links (FSDP2 docs: implicit forward prefetch, one group
    of explicit backward prefetch):
      forward   the root's gather and the first layer's gathers wait (nothing computes before them:
                FSDP2 does not prefetch across the chunk's calls); layer i+1's gathers run behind layer
                i's forward: max(0, gather - forward_i)
      backward  with reshard after forward (ZeRO-3, megafab's default) the last layer's gathers run
                behind the output layer's backward (last stage) or wait; during layer i's backward the
                links carry layer i-1's prefetched gathers and, in the micro-batch that reduces, layer
                i+1's reduce-scatters: max(0, gather + reduce-scatter - backward_i)
      tail      in the micro-batch that reduces, the first layer's and the root's reduce-scatters after
                the chunk's last backward (the root's post-backward runs in FSDP2's final callback)
    Every micro-batch but the last runs in no_sync: gathers in forward and (resharded) in backward
    each micro-batch, reduce-scatters only in the last one.
    """
    regather = cfg.parallel.fsdp_reshard_after_forward
    per_mb = reducing = tail = 0.0
    last_chunk = len(chunks) - 1
    for c, (root, layers) in enumerate(chunks):
        if not layers:
            per_mb += root.gather + root.copy_out
            reducing += root.copy_in
            tail += root.reduce
            continue
        units = [layer.unit for layer in layers]
        fwd = root.gather + root.copy_out + units[0].gather + sum(u.copy_out for u in units)
        fwd += sum(max(0.0, nxt.gather - layer.forward) for layer, nxt in zip(layers, units[1:]))
        # backward, layer i (in reverse): the links carry layer i-1's gather (resharded only) and
        # layer i+1's reduce-scatter (in the reducing micro-batch)
        gathers = [0.0] + [u.gather if regather else 0.0 for u in units[:-1]]
        reduces = [u.reduce for u in units[1:]] + [0.0]
        cover = output_cover if c == last_chunk else 0.0
        head = max(0.0, units[-1].gather - cover) if regather else 0.0
        plain = head + sum(max(0.0, g - layer.backward) for g, layer in zip(gathers, layers))
        with_reduce = head + sum(max(0.0, g + rs - layer.backward)
                                 for g, rs, layer in zip(gathers, reduces, layers))
        copies = sum(u.copy_out for u in units) if regather else 0.0
        accumulate = root.accumulate + sum(u.accumulate for u in units) if accumulating else 0.0
        per_mb += fwd + plain + copies + accumulate
        reducing += with_reduce - plain + root.copy_in + sum(u.copy_in for u in units)
        tail += units[0].reduce + root.reduce
    return StageFsdp(per_mb, reducing, tail)
