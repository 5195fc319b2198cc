"""The distributed optimizer's parameter all-gather, bucket by bucket (`--overlap-param-gather`).

After an optimizer step each DP rank holds fresh values only in its own shard of every bucket of
the parameter buffer (data_parallel.py); an all-gather per bucket over the bucket's group (DP, or
expert-DP for expert buckets) brings the rest. Without overlap, `sync()` gathers every bucket
before step() returns. With overlap (Megatron's design): step() only marks every bucket stale,
the next zero_grad() dispatches the first bucket the forward needs, and a forward pre-hook on each
module that owns bucketed parameters dispatches the *next* bucket and waits for its own, so bucket
k+1 travels while the modules of bucket k compute (ParamGather). Each VPP chunk has its own
buckets and hooks. A chunk's forward ends with nothing in flight; anything that reads the weights
outside a forward (checkpoint save) calls `finish_param_syncs` first. An FP8 bucket's uint8 data
is followed by TE's post-all-gather processing of its weights (model/fp8_params.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megafab.distributed.mappings import all_gather_single
from megafab.model.fp8_params import post_all_gather
from megafab.run import faults

GLOO_SLICE = 1 << 20  # elements of each rank's shard per gloo bucket collective (4 MiB in fp32)


class Done:
    """Handle of a collective that already finished (DP=1 or a synchronous call)."""

    def wait(self):
        return True


def all_gather_bucket(data: torch.Tensor, dp: int, dp_rank: int, group, async_op: bool):
    """All-gather the dp equal shards of `data` (rank r holds the r-th) in place; returns (handle,
    the input copy the collective reads until it is done). gloo gathers into a flat copy of the
    whole output before copying it out (a transient of the bucket's size: 153 MiB for a 40M-element
    fp32 bucket), so there a large bucket is gathered in slices (all_gather_in_slices) and the
    result is returned done."""
    rows = data.view(dp, -1)  # row r: rank r's shard
    if sliced_on_gloo(rows.shape[1], group):
        all_gather_in_slices(data, dp, dp_rank, group)
        return Done(), None
    # The input is a view of the output; copy it so the collective never reads what it writes.
    shard = rows[dp_rank].clone()
    return all_gather_single(data, shard, group=group, async_op=async_op) or Done(), shard


def sliced_on_gloo(per_rank: int, group) -> bool:
    """A collective of `per_rank` elements per rank over `group` goes in GLOO_SLICE slices."""
    return per_rank > GLOO_SLICE and dist.get_backend(group) == "gloo"


def all_gather_in_slices(data: torch.Tensor, dp: int, dp_rank: int, group) -> None:
    """all_gather_bucket's gloo path: GLOO_SLICE elements per rank at a time, straight into the
    rank rows of `data`, each finished before the next; gloo's flat copy stays at dp x GLOO_SLICE
    elements and the bytes sent are the same."""
    rows = data.view(dp, -1)
    for lo in range(0, rows.shape[1], GLOO_SLICE):
        hi = min(lo + GLOO_SLICE, rows.shape[1])
        dist.all_gather(list(rows[:, lo:hi].unbind(0)), rows[dp_rank, lo:hi].clone(), group=group)


class ParamGather:
    """Per-bucket all-gather state of one model chunk's parameter buffer.

    buckets: data_parallel.Bucket list (bucket.param_data views the buffer; bucket.group, .dp,
    .dp_rank: the group it is gathered over); a bucket is synced, stale (this rank's shard is new,
    the others are not gathered yet) or in flight.

    Which module waits for which bucket is learnt from the chunk's first forward (always before
    the first step, so nothing is stale then): a parameter's bucket is waited for by its owner's
    pre-hook if the owner's forward ran, else by the nearest ancestor whose forward ran (a weight
    used by the parent directly, e.g. the output layer's in GPTModel.forward). Forward order is the
    order those modules first ran; dense and expert buckets share it, so either kind travels while
    the other computes.

    What overlaps: the gather of a chunk's first bucket with the host work between zero_grad() and
    its first forward (batch loading, the pipeline's warmup receives), and the gather of each later
    bucket with the forward compute of the bucket before it. The interleaved schedule's first
    forward of chunk k waits only for chunk k's buckets. A forward with stale buckets and no
    dispatch (evaluation right after a step) gathers through the same hooks; one before any step
    finds nothing stale. A chunk's forward ends by waiting for whatever its hooks did not consume
    (parameters no module's forward touched); nothing is dispatched after a run's last step.
    """

    def __init__(self, module: nn.Module, buckets: list, param_to_bucket: dict):
        self.module = module
        self.buckets = buckets
        self.forward_order = list(reversed(buckets))  # until the first forward says otherwise
        self.param_to_bucket = param_to_bucket
        self.stale: set[int] = set()  # bucket indices to gather, not dispatched
        self.in_flight: dict[int, tuple] = {}  # bucket index -> (handle, input copy)
        self._ran: dict[nn.Module, int] = {}  # module -> when its forward first ran
        self._probes = [m.register_forward_pre_hook(self._probe) for m in module.modules()]
        self._waits: dict[nn.Module, list] = {}  # module -> buckets its pre-hook waits for
        self._hooks: list = []

    @property
    def pending(self) -> bool:
        """Some bucket is stale or in flight (the hooks' fast path: False)."""
        return bool(self.stale or self.in_flight)

    # ---- one bucket -------------------------------------------------------------------------
    def dispatch(self, bucket, async_op: bool = True) -> None:
        """Start the all-gather of a stale bucket."""
        self.stale.discard(bucket.index)
        if bucket.dp == 1:
            self.in_flight[bucket.index] = (Done(), None)
            return
        self.in_flight[bucket.index] = all_gather_bucket(bucket.param_data, bucket.dp, bucket.dp_rank,
                                                         bucket.group, async_op)

    def wait(self, bucket) -> None:
        """Bucket's gather complete: dispatch it first if it is still stale."""
        if bucket.index in self.stale:
            self.dispatch(bucket)
        handle, _ = self.in_flight.pop(bucket.index)
        faults.wait(handle, "parameter all-gather (data parallel)", bucket.group)
        if bucket.fp8:  # TE's processing of the gathered FP8 weights (their transposes)
            post_all_gather(bucket.params)

    def _consume(self, bucket, position: int) -> None:
        """A module of `bucket` is about to run: send the next bucket on, then wait for this one."""
        if bucket.index not in self.stale and bucket.index not in self.in_flight:
            return
        if bucket.index in self.stale:
            self.dispatch(bucket)
        if position + 1 < len(self.forward_order):
            following = self.forward_order[position + 1]
            if following.index in self.stale:
                self.dispatch(following)
        self.wait(bucket)

    # ---- the whole chunk ----------------------------------------------------------------------
    def defer(self) -> None:
        """This rank's shards were just updated: gather lazily, in the next forward's pre-hooks."""
        assert not self.in_flight, "a parameter gather is still in flight while the optimizer steps"
        self.stale = {b.index for b in self.buckets}
        if not self._hooks:
            self._install_hooks()

    def dispatch_first(self) -> None:
        """Start the gather of the first stale bucket the forward needs."""
        for bucket in self.forward_order:
            if bucket.index in self.stale:
                self.dispatch(bucket)
                return

    def start(self, async_op: bool = False) -> None:
        """Dispatch every bucket (checkpoint load, overlap off)."""
        assert not self.in_flight, "a parameter gather is already in flight"
        for bucket in self.forward_order:
            self.dispatch(bucket, async_op)

    def sync(self) -> None:
        """Every bucket gathered: dispatch what is stale, wait for what is in flight."""
        for bucket in self.forward_order:
            if bucket.index in self.stale or bucket.index in self.in_flight:
                self.wait(bucket)

    def after_forward(self) -> None:
        """End of a chunk forward: learn the wait plan after the first; land what no hook consumed
        (parameters no forward touched), so nothing stays in flight into backward or the step."""
        if self._probes:
            for handle in self._probes:
                handle.remove()
            self._probes = []
            self._plan()
            if self._hooks:  # installed before this first forward (a checkpoint load)
                self._install_hooks()
        if self.pending:
            self.sync()

    # ---- the wait plan ------------------------------------------------------------------------
    def _probe(self, module, _args):
        self._ran.setdefault(module, len(self._ran))

    def _plan(self) -> None:
        parent = {child: m for m in self.module.modules() for child in m.children()}
        waits: dict[nn.Module, list] = {}
        for owner in self.module.modules():
            waiter = owner
            while waiter not in self._ran and waiter in parent:
                waiter = parent[waiter]
            for p in owner.parameters(recurse=False):
                bucket = self.param_to_bucket.get(p)
                if bucket is not None and bucket not in waits.setdefault(waiter, []):
                    waits[waiter].append(bucket)
        waits = {m: b for m, b in waits.items() if b}
        order = []
        for module in sorted(waits, key=lambda m: self._ran.get(m, -1)):
            order += [b for b in waits[module] if b not in order]
        order += [b for b in reversed(self.buckets) if b not in order]
        self.forward_order, self._waits = order, waits

    def _install_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        # Before the first forward the chunk's own pre-hook waits for everything.
        waits = self._waits or {self.module: list(self.forward_order)}
        position = {b.index: i for i, b in enumerate(self.forward_order)}
        self._hooks = [module.register_forward_pre_hook(self._make_hook(buckets, position))
                       for module, buckets in waits.items()]

    def _make_hook(self, buckets: list, position: dict):
        def hook(_module, _args):
            if self.pending:
                for bucket in buckets:
                    self._consume(bucket, position[bucket.index])
        return hook


def finish_param_syncs(model_chunks) -> None:
    """Every chunk's parameters gathered (before reading weights outside a forward, e.g. a save)."""
    for chunk in model_chunks:
        gather = getattr(chunk, "param_gather", None)
        if gather is not None:
            gather.sync()

