"""Data parallelism: gradients in one contiguous buffer, split into buckets, reduced over DP.

    grad buffer  [ bucket 0 | bucket 1 | ... ]            one flat tensor of `grad_dtype`
    bucket k     [ last params of the model ... | pad ]   numel divisible by DP

Parameters are laid out in reverse order, the order backward produces their gradients, so the first
bucket fills first. Every `param.main_grad` is a view into the buffer; gradients accumulate there
over micro-batches in `grad_dtype` (fp32 for bf16/fp16 models), added by the TP linear layers
directly (gradient accumulation fusion, linear.py) or by a post-accumulate-grad hook that also does
the bucket bookkeeping. A bucket is all-reduced over DP, or reduce-scattered with the distributed
optimizer (DP rank r owns the r-th 1/DP of every bucket, and its parameters live in a param buffer
of the same layout for param_gather.py). With `overlap_grad_reduce` a bucket's collective starts
during the last micro-batch's backward as soon as it is full; `finish_grad_sync()` waits for them.
Routed experts get buckets over expert-DP (_plan); the scaling to a DP average: _start_bucket_sync.
TE's FP8 weights (--fp8-param-gather) get buckets of their own whose param buffer is uint8
(model/fp8_params.py): one param buffer per run of buckets of one kind.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.distributed as dist
from torch import nn

from megafab.config import default_bucket_size
from megafab.distributed.mappings import reduce_scatter_single
from megafab.distributed.param_gather import GLOO_SLICE, Done, ParamGather
from megafab.errors import MegafabError
from megafab.model.fp8_params import cast_masters, is_fp8_param, replace_raw_data
from megafab.run import faults


def reduce_scatter_bucket(shard: torch.Tensor, data: torch.Tensor, op, group, async_op: bool):
    """reduce_scatter_single(shard, data). gloo copies a reduce-scatter's whole input (a transient
    of the bucket's size, the whole model with one bucket), so there a large bucket is reduced in
    slices of GLOO_SLICE elements per rank, each finished before the next: the copy stays at
    dp x GLOO_SLICE elements, the bytes sent are the same, and the result is returned done."""
    per_rank = shard.numel()
    if per_rank <= GLOO_SLICE or dist.get_backend(group) != "gloo":
        return reduce_scatter_single(shard, data, op=op, group=group, async_op=async_op)
    rows = data.view(-1, per_rank)  # row r: rank r's shard
    for lo in range(0, per_rank, GLOO_SLICE):
        hi = min(lo + GLOO_SLICE, per_rank)
        reduce_scatter_single(shard[lo:hi], rows[:, lo:hi].reshape(-1), op=op, group=group)
    return Done()


class DataParallelConfigError(MegafabError):
    """A data-parallel setting that cannot work; the message names the value and the fix."""


def bucket_size_problems(bucket_size: int | None) -> list[str]:
    """Why --ddp-bucket-size cannot be used (the config check asks this before start)."""
    if bucket_size is not None and bucket_size < 1:
        return [f"--ddp-bucket-size is {bucket_size}; it must be a positive number of elements "
                f"(or unset for Megatron's default)"]
    return []


def main_grad_dtype(params: list[nn.Parameter], grad_dtype: torch.dtype | None) -> torch.dtype:
    """fp32 main grads unless asked otherwise; a float64 model keeps float64 (parity tests)."""
    if grad_dtype is not None:
        return grad_dtype
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def is_expert_param(param: nn.Parameter) -> bool:
    """A routed-expert parameter: reduced (and sharded) over expert-DP, not DP."""
    return getattr(param, "is_expert", False)


class Bucket:
    """A contiguous [start, end) range of the buffers, the parameters it holds, and the group it
    is reduced over (DP for dense params, expert-DP for expert params; `dp` ranks, this rank
    `dp_rank` of them)."""

    def __init__(self, index: int, params: list[nn.Parameter], start: int, end: int, dp: int,
                 group=None, dp_rank: int = 0, expert: bool = False, fp8: bool = False):
        self.index = index
        self.params = params
        self.start = start
        self.end = end
        self.dp = dp
        self.shard_size = (end - start) // dp
        self.group = group
        self.dp_rank = dp_rank
        self.expert = expert
        self.fp8 = fp8  # TE FP8 weights: the param buffer holds their raw uint8 data
        self.pending: set[int] = set()
        self.handle = None
        self.grad_data: torch.Tensor | None = None
        self.param_data: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, dp_rank: int | None = None) -> tuple[int, int]:
        """The buffer range [start, end) rank `dp_rank` of the bucket's group (default: this
        rank) owns under the distributed optimizer."""
        lo = self.start + (self.dp_rank if dp_rank is None else dp_rank) * self.shard_size
        return lo, lo + self.shard_size


def plan_buckets(ordered: list[nn.Parameter], dp: int, bucket_size: int | None,
                 use_distributed_optimizer: bool, start: int = 0, first_index: int = 0
                 ) -> tuple[list[Bucket], dict[nn.Parameter, int]]:
    """Buckets over `ordered` params and each param's buffer offset (a pure function of the sizes),
    the first at buffer offset `start` with index `first_index`.

    Greedy: close a bucket once it holds bucket_size elements; pad it to a multiple of DP.
    """
    buckets, current, filled = [], [], 0
    offsets: dict[nn.Parameter, int] = {}

    def close():
        nonlocal start, filled, current
        end = start + math.ceil(filled / dp) * dp
        buckets.append(Bucket(first_index + len(buckets), current, start, end, dp))
        start, filled, current = end, 0, []

    def alone(p):
        # Both tied-embedding copies (first and last stage) must be sharded alike across DP.
        return use_distributed_optimizer and getattr(p, "shared_embedding", False)

    for p in ordered:
        if alone(p) and current:
            close()
        offsets[p] = start + filled
        filled += p.numel()
        current.append(p)
        if bucket_size is not None and filled >= bucket_size:
            close()
        elif alone(p):
            close()
    if current:
        close()
    return buckets, offsets


def owned_ranges(buckets: list[Bucket], offsets: dict[nn.Parameter, int], dp_rank: int | None = None
                 ) -> dict[nn.Parameter, tuple[int, int]]:
    """Per param, the flat param-local range [lo, hi) inside rank `dp_rank`'s shard of every bucket
    (rank in each bucket's own group; default this rank; params it owns nothing of are absent). The
    ranges of all ranks of a bucket's group tile each of its params once."""
    owned = {}
    for bucket in buckets:
        shard_lo, shard_hi = bucket.shard_range(dp_rank)
        for p in bucket.params:
            p_lo = offsets[p]
            lo, hi = max(p_lo, shard_lo), min(p_lo + p.numel(), shard_hi)
            if lo < hi:
                owned[p] = (lo - p_lo, hi - p_lo)
    return owned


class DistributedDataParallel(nn.Module):
    """Wraps a module (one pipeline stage or VPP chunk) and owns its gradient buffer.

    Arguments:
        module: the model chunk; its trainable parameters get `.main_grad`.
        dp_group: the data-parallel group the dense buckets are reduced over (DP x CP); its size
            is the DP every gradient is averaged over.
        expert_dp_group: the expert-DP group the expert params' buckets are reduced over
            (`topo.group("edp")`); None = dp_group (right only at expert-parallel size 1).
        grad_dtype: dtype of the main grads; None = fp32 (fp64 if the model is fp64).
        bucket_size: elements per bucket; None = one bucket, or Megatron's max(40M, 1M x DP)
            when overlapping (one bucket cannot overlap anything).
        overlap_grad_reduce: start each bucket's collective during backward.
        use_distributed_optimizer: reduce-scatter instead of all-reduce, keep params in a buffer.
        average_in_collective: average with ReduceOp.AVG (NCCL) instead of pre-dividing by DP;
            falls back to pre-dividing on backends without AVG (gloo).
        device: where the buffers live (default: the parameters' device); with the distributed
            optimizer a chunk built on the meta device gets its parameters as views of the
            param buffer, to be filled (megafab.distributed.fsdp.fill_shards).
    """

    def __init__(self, module: nn.Module, *, dp_group, expert_dp_group=None,
                 grad_dtype: torch.dtype | None = None,
                 bucket_size: int | None = None, overlap_grad_reduce: bool = False,
                 use_distributed_optimizer: bool = False, average_in_collective: bool = False,
                 device: torch.device | None = None):
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        self.dp = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.expert_dp_group = dp_group if expert_dp_group is None else expert_dp_group
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.average_in_collective = average_in_collective
        self.is_last_microbatch = True
        if bucket_size is None and overlap_grad_reduce:
            bucket_size = default_bucket_size(self.dp)
        problems = bucket_size_problems(bucket_size)
        if problems:
            raise DataParallelConfigError(problems[0])
        self.bucket_size = bucket_size

        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise DataParallelConfigError("DistributedDataParallel got a module with no trainable "
                                          "parameters; wrap the model chunk that holds the weights")
        self.grad_dtype = main_grad_dtype(params, grad_dtype)
        self.params = params
        self.buckets, self._offsets = self._plan(params)
        self.numel = self.buckets[-1].end
        device = device or params[0].device
        self.grad_buffer = torch.zeros(self.numel, dtype=self.grad_dtype, device=device)
        self.param_buffer = None  # the model-dtype param buffer (distributed optimizer)
        self.param_buffers: list[tuple[int, int, torch.Tensor]] = []  # (start, end, buffer) per run
        self._fp8_pending: dict[nn.Parameter, torch.Tensor] | None = None  # a load's, to cast
        if use_distributed_optimizer:
            dtypes = {p.dtype for p in params if not is_fp8_param(p)}
            if len(dtypes) > 1:
                raise DataParallelConfigError(
                    f"the distributed optimizer needs one parameter dtype per model chunk, got "
                    f"{sorted(str(d) for d in dtypes)}; cast the model to one dtype first")
            self._make_param_buffers(dtypes.pop() if dtypes else params[0].dtype, device)
        self.param_to_bucket: dict[nn.Parameter, Bucket] = {}
        for bucket in self.buckets:
            bucket.grad_data = self.grad_buffer[bucket.start:bucket.end]
            if self.param_buffers:
                bucket.param_data = self._param_view(bucket.start, bucket.end)
        self._place_params()
        self.param_gather = None
        if use_distributed_optimizer:
            self.param_gather = ParamGather(module, self.buckets, self.param_to_bucket)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook()) for p in params]
        self.reset_bucket_state()

    # ---- layout -----------------------------------------------------------------------------
    def _plan(self, params: list[nn.Parameter]) -> tuple[list[Bucket], dict[nn.Parameter, int]]:
        """Dense buckets (over DP), then expert buckets (over expert-DP), in one buffer.

        Expert parameters (`param.is_expert`, the routed experts of MoE layers) are distinct across
        expert-parallel ranks and replicated only across expert-DP (megatron-core's expert grid:
        ETP x EP x expert-DP x PP over the same ranks, CP folded into expert-DP). Their buckets
        come after the dense ones in the same buffers (megatron-core's expert_parallel_buffers),
        each padded to a multiple of expert-DP; under the distributed optimizer each expert-DP rank
        owns the matching shard. Each bucket carries its group, so the reduction, the ownership and
        the parameter gather read the group off the bucket."""
        buckets, offsets = [], {}
        for expert, group in ((False, self.dp_group), (True, self.expert_dp_group)):
            for fp8 in (False, True):  # FP8 weights apart: their param buffer is uint8
                mine = [p for p in params if is_expert_param(p) == expert and is_fp8_param(p) == fp8]
                if not mine:
                    continue
                size, rank = dist.get_world_size(group), dist.get_rank(group)
                planned, placed = plan_buckets(list(reversed(mine)), size, self.bucket_size,
                                               self.use_distributed_optimizer,
                                               start=buckets[-1].end if buckets else 0,
                                               first_index=len(buckets))
                for bucket in planned:
                    bucket.group, bucket.dp_rank, bucket.expert, bucket.fp8 = group, rank, expert, fp8
                buckets += planned
                offsets.update(placed)
        return buckets, offsets

    def _make_param_buffers(self, dtype: torch.dtype, device) -> None:
        """One param buffer per run of buckets of one kind: `dtype`, or uint8 for FP8 weights (their
        raw data, 1 byte per parameter; megatron-core's buffers per param dtype)."""
        runs: list[list[Bucket]] = []
        for bucket in self.buckets:
            if runs and runs[-1][0].fp8 == bucket.fp8:
                runs[-1].append(bucket)
            else:
                runs.append([bucket])
        for run in runs:
            start, end = run[0].start, run[-1].end
            buffer = torch.zeros(end - start, dtype=torch.uint8 if run[0].fp8 else dtype, device=device)
            self.param_buffers.append((start, end, buffer))
            if self.param_buffer is None and not run[0].fp8:
                self.param_buffer = buffer
        if self.param_buffer is None:
            self.param_buffer = self.param_buffers[0][2]

    def _param_view(self, lo: int, hi: int) -> torch.Tensor:
        for start, end, buffer in self.param_buffers:
            if start <= lo and hi <= end:
                return buffer[lo - start:hi - start]
        raise AssertionError(f"[{lo}, {hi}) spans two param buffers")

    def _place_params(self):
        for bucket in self.buckets:
            for p in bucket.params:
                lo = self._offsets[p]
                hi = lo + p.numel()
                self.param_to_bucket[p] = bucket
                p.main_grad = self.grad_buffer[lo:hi].view(p.shape)
                if self.param_buffers and is_fp8_param(p):
                    if p.is_meta:
                        raise DataParallelConfigError("FP8 weights (--fp8-param-gather) are built on the "
                                                      "device, not the meta device")
                    replace_raw_data(p, self._param_view(lo, hi))  # its raw data: a view of the buffer
                elif self.param_buffers and p.is_meta:
                    # a meta-built chunk: p becomes a view of the buffer, its values filled later
                    # (.data, not a view parameter: a view would share the buffer's version counter,
                    # and a later bucket's all-gather landing in the forward would then invalidate
                    # every weight autograd saved before it)
                    attributes, shape = dict(p.__dict__), p.shape
                    torch.utils.swap_tensors(p, nn.Parameter(self.param_buffer.new_empty(0),
                                                             requires_grad=p.requires_grad))
                    p.__dict__.update(attributes)
                    p.data = self._param_view(lo, hi).view(shape)
                elif self.param_buffers:
                    self._param_view(lo, hi).copy_(p.data.view(-1))
                    p.data = self._param_view(lo, hi).view(p.shape)

    def owned_param_ranges(self, dp_rank: int | None = None) -> dict[nn.Parameter, tuple[int, int]]:
        """owned_ranges of this chunk's buckets for `dp_rank` (the rank in each bucket's group:
        DP for dense params, expert-DP for expert params; default: this rank)."""
        return owned_ranges(self.buckets, self._offsets, dp_rank)

    # ---- backward hooks -----------------------------------------------------------------------
    def _make_hook(self):
        # The hook lives in the parameter's C++ autograd metadata, where Python's cycle collector
        # cannot see it: a closure over `self` would keep this chunk and its buffers alive for good
        # once it is dropped (measured: a freed 91M-parameter state kept 700 MiB per rank).
        chunk = weakref.ref(self)

        def hook(param: nn.Parameter):
            self = chunk()
            # grad is None when the linear core already added it into main_grad (accumulation fusion)
            if param.grad is not None:
                param.main_grad.add_(param.grad)
                param.grad = None
            if self.overlap_grad_reduce and self.is_last_microbatch:
                bucket = self.param_to_bucket[param]
                bucket.pending.discard(id(param))
                if not bucket.pending and bucket.handle is None:
                    self._start_bucket_sync(bucket, async_op=True)
        return hook

    def reset_bucket_state(self):
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}
            bucket.handle = None

    # ---- collectives --------------------------------------------------------------------------
    def _use_avg_op(self) -> bool:
        return dist.get_backend(self.dp_group) == "nccl"

    def _start_bucket_sync(self, bucket: Bucket, async_op: bool):
        """Scale and reduce one bucket (megatron-core's gradient_scaling_factor), so that every
        gradient is the average over the DP x CP ranks' losses: dense, x 1/DP before a sum over DP
        (or ReduceOp.AVG over DP); expert, x 1/DP before a sum over expert-DP (or x expert-DP/DP
        before ReduceOp.AVG over expert-DP). The expert-parallel token exchange already summed,
        into each EP rank's experts, the contributions of the DP ranks of its EP group; the sum
        over expert-DP adds the rest, so 1/DP averages the total, also when expert-DP is 1."""
        data = bucket.grad_data
        op, factor = dist.ReduceOp.SUM, 1.0 / self.dp  # the average over DP
        if self.average_in_collective and self._use_avg_op():
            op, factor = dist.ReduceOp.AVG, bucket.dp / self.dp  # AVG divides by the bucket's group
        if factor != 1.0:
            data.mul_(factor)
        if bucket.dp == 1:
            bucket.handle = Done()
            return
        if self.use_distributed_optimizer:
            lo, hi = bucket.shard_range()
            shard = self.grad_buffer[lo:hi]
            bucket.handle = reduce_scatter_bucket(shard, data, op, bucket.group, async_op)
        else:
            bucket.handle = dist.all_reduce(data, op=op, group=bucket.group, async_op=async_op)
        if bucket.handle is None:
            bucket.handle = Done()

    def start_grad_sync(self):
        """Launch every bucket's collective that has not started yet."""
        for bucket in self.buckets:
            if bucket.handle is None:
                self._start_bucket_sync(bucket, async_op=self.overlap_grad_reduce)

    def finish_grad_sync(self):
        """Wait until every bucket is reduced; after this main_grad holds the DP-averaged gradient
        (only this rank's shard of each bucket, in the bucket's group, with the distributed
        optimizer)."""
        self.start_grad_sync()
        for bucket in self.buckets:
            faults.wait(bucket.handle, "gradient reduction (data parallel)", bucket.group)
        self.reset_bucket_state()

    def cast_fp8_shards(self, owned_values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Cast each FP8 weight's owned range (`owned_values[p]`, flat, high precision) into its
        shard of the uint8 param buffer with TE's cast_master_weights_to_fp8, one call per bucket
        group (its amax reduction is collective: every rank lists every FP8 weight of the group,
        None where it owns nothing). The buckets are all-gathered afterwards."""
        if not any(b.fp8 for b in self.buckets):
            return
        owned = self.owned_param_ranges()
        for expert in (False, True):
            fp8 = [b for b in self.buckets if b.fp8 and b.expert == expert]
            params = [p for b in fp8 for p in b.params]
            if params:
                cast_masters(params, [owned_values.get(p) for p in params],
                             [owned[p][0] if p in owned_values else None for p in params], fp8[0].group)

    def load_fp8_shards(self, owned_values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Values read into the FP8 weights' owned ranges: cast by the next start_param_sync."""
        self._fp8_pending = {**(self._fp8_pending or {}), **owned_values}

    def start_param_sync(self, async_op: bool = False):
        """All-gather every bucket's updated parameter shards (distributed optimizer only)."""
        assert self.param_gather is not None, "param sync needs use_distributed_optimizer=True"
        if self._fp8_pending is not None:  # on every rank, owning any of the weights or not
            self.cast_fp8_shards(self._fp8_pending)
            self._fp8_pending = None
        self.param_gather.start(async_op)

    def finish_param_sync(self):
        """Every bucket's parameters gathered (stale buckets are gathered now)."""
        if self.param_gather is not None:
            self.param_gather.sync()

    def defer_param_sync(self):
        """The optimizer updated this rank's shards: gather each bucket in the next forward."""
        self.param_gather.defer()

    def zero_grad_buffer(self):
        """Zero the main grads before the first micro-batch of a step."""
        self.grad_buffer.zero_()
        for p in self.params:
            p.grad = None
        self.reset_bucket_state()

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches run inside only accumulate; the collectives wait for the last one."""
        previous = self.is_last_microbatch
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = previous

    def forward(self, *args, **kwargs):
        output = self.module(*args, **kwargs)
        if self.param_gather is not None:
            self.param_gather.after_forward()
        return output

    def set_input_tensor(self, tensor) -> None:
        """Pipeline schedules hand a stage its input through the wrapped chunk."""
        self.module.set_input_tensor(tensor)

