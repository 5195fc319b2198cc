"""The one pipeline order: which forward and backward passes a stage runs, and in what order.

Megatron's 1F1B (one model chunk per stage) and interleaved 1F1B (v chunks; chunk c of stage r is
virtual stage c*p + r). Every stage runs its forwards in one order, `forward_order`: micro-batches
in groups of N (Megatron's microbatch_group_size_per_vp_stage, default p), each group through chunk
0, then chunk 1, ...; the last group takes whatever is left. Backward k is forward k's micro-batch
through the chunks in reverse. Stage r of p with v*m passes each way runs
    warmup    w forwards: p-r-1 (1F1B) or 2(p-r-1) + (v-1)N (interleaved), at most v*m; all of
              them when forward_only
    steady    forward w+i then backward i, for i < v*m - w
    cooldown  the remaining backwards.
The executors (pipeline.py, pipeline_interleaved.py) run this table; the planner's step-time model
(megafab.plan.schedule) runs it through time. Pure Python: no torch, no process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

WARMUP, STEADY, COOLDOWN = "warmup", "steady", "cooldown"


@dataclass(frozen=True)
class Pass:
    """One forward or backward of one micro-batch through one of the stage's model chunks.

    step: the pass's place among this stage's passes of its direction (Megatron's virtual
    micro-batch id), the same for every stage.
    """
    forward: bool
    microbatch: int
    chunk: int
    phase: str
    step: int


def forward_order(num_microbatches: int, vpp: int, group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of every forward, in the order each stage runs them."""
    order = []
    for start in range(0, num_microbatches, group_size):
        end = num_microbatches if start + group_size >= num_microbatches else start + group_size
        order += [(mb, chunk) for chunk in range(vpp) for mb in range(start, end)]
    return order


def backward_order(num_microbatches: int, vpp: int, group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of every backward: forward k's micro-batch, chunks reversed."""
    return [(mb, vpp - 1 - chunk) for mb, chunk in forward_order(num_microbatches, vpp, group_size)]


def num_warmup(pp_rank: int, pp: int, num_microbatches: int, vpp: int = 1,
               group_size: int | None = None, forward_only: bool = False) -> int:
    """How many forwards stage pp_rank runs before its first backward."""
    total = num_microbatches * vpp
    if forward_only:
        return total
    if vpp == 1:
        return min(pp - pp_rank - 1, total)
    return min(2 * (pp - pp_rank - 1) + (vpp - 1) * (group_size or pp), total)


def schedule_table(pp_rank: int, pp: int, num_microbatches: int, vpp: int = 1,
                   group_size: int | None = None, forward_only: bool = False) -> list[Pass]:
    """Every pass stage pp_rank runs, in order. Any m >= 1 gives a table; whether the executors
    can run it without waiting on themselves is interleaving_problem's question."""
    assert 0 <= pp_rank < pp and num_microbatches >= 1 and vpp >= 1, (pp_rank, pp, num_microbatches, vpp)
    group = group_size or pp
    forwards = forward_order(num_microbatches, vpp, group)
    if forward_only:
        return [Pass(True, mb, c, WARMUP, k) for k, (mb, c) in enumerate(forwards)]
    backwards = backward_order(num_microbatches, vpp, group)
    total = len(forwards)
    warmup = num_warmup(pp_rank, pp, num_microbatches, vpp, group)
    table = [Pass(True, *forwards[k], WARMUP, k) for k in range(warmup)]
    for i in range(total - warmup):
        table += [Pass(True, *forwards[warmup + i], STEADY, warmup + i),
                  Pass(False, *backwards[i], STEADY, i)]
    return table + [Pass(False, *backwards[k], COOLDOWN, k) for k in range(total - warmup, total)]


def interleaving_problem(num_microbatches: int, pp: int, group_size: int | None = None) -> str | None:
    """Why the interleaved schedule cannot run m micro-batches in groups of N (megatron-core's
    rule: N in [p, m], and the last group whole or at least p), or None."""
    group = group_size or pp
    if group_size is not None and not pp <= group <= num_microbatches:
        return (f"microbatch_group_size_per_vp_stage {group} must lie between "
                f"pipeline-model-parallel-size {pp} and num_microbatches {num_microbatches}")
    left = num_microbatches % group
    if group_size is None and left:
        return (f"num_microbatches {num_microbatches} is not divisible by pipeline-model-parallel-size "
                f"{pp}; the interleaved schedule runs micro-batches in groups of {pp}, so pick a global "
                f"batch size giving a multiple of {pp} micro-batches, or drop virtual pipeline stages")
    if 0 < left < pp:
        return (f"num_microbatches {num_microbatches} in groups of microbatch_group_size_per_vp_stage "
                f"{group} leaves a last group of {left}, fewer than pipeline-model-parallel-size {pp}; "
                f"pick a group size that divides {num_microbatches} or leaves at least {pp}")
    return None


def upstream(pp_rank: int, p: Pass, pp: int, vpp: int) -> tuple[int, bool, int, int] | None:
    """(stage, forward, micro-batch, chunk) of the pass whose output `p` consumes: the previous
    virtual stage's forward, the next virtual stage's backward (the ring wraps from the last stage
    to the first); None for the first virtual stage's forward, and for the last's backward (it
    starts from its own loss, computed by its own forward)."""
    if p.forward:
        if pp_rank > 0:
            return pp_rank - 1, True, p.microbatch, p.chunk
        return (pp - 1, True, p.microbatch, p.chunk - 1) if p.chunk > 0 else None
    if pp_rank < pp - 1:
        return pp_rank + 1, False, p.microbatch, p.chunk
    return (0, False, p.microbatch, p.chunk + 1) if p.chunk < vpp - 1 else None
