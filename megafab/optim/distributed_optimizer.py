"""The distributed optimizer (ZeRO-1, Megatron's `--use-distributed-optimizer`).

One step, per DP rank r of d DP ranks (with context parallelism the DP x CP group, d = dp * cp):

    grad buffer (fp32)  [ bucket 0: s0 | s1 | .. | s(d-1) ][ bucket 1: s0 | .. ] ...
    1. backward fills the buffer; DDP reduce-scatters each bucket -> s_r holds the DP-mean grad
    2. for every param overlapping s_r, its fp32 main shard takes that slice of grad
    3. norm / clip / inf check on the owned slices, reduced over DP and model parallel
    4. AdamW steps the owned main shards (exp_avg, exp_avg_sq exist only for them)
    5. the main shards are written into the param buffer (model dtype) and every bucket is
       all-gathered over DP, so every rank again holds all parameters

Memory per parameter (bf16 model, fp32 grads, Megatron's table): 6 + 12/d bytes (18 without the
distributed optimizer); for fp32 models the main shard is a view of the param buffer, 8/d sharded.
TE's FP8 weights (--fp8-param-gather): 1 byte in the uint8 param buffer + 4 of fp32 grad + 12/d of
main and Adam state, 5 + 12/d; their mains start from the init values, and step 5 casts them with TE
(DistributedDataParallel.cast_fp8_shards) before the uint8 buckets are gathered.
"""

from __future__ import annotations

import torch
from torch import nn

from megafab.distributed.data_parallel import DistributedDataParallel
from megafab.model.fp8_params import drop_init_values, is_fp8_param, main_start
from megafab.optim.mixed_precision import (
    LOW_PRECISION,
    MainParam,
    MixedPrecisionOptimizer,
    OptimizerConfigError,
    no_weight_decay,
)


def owned_param_ranges(ddp: DistributedDataParallel, dp_rank: int | None = None
                       ) -> dict[nn.Parameter, tuple[int, int]]:
    """Per param, the flat param-local range [lo, hi) that `dp_rank` owns (params it owns nothing
    of are absent). The ranges of all DP ranks tile each param exactly once."""
    return ddp.owned_param_ranges(dp_rank)


class DistributedOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer whose main params and Adam state cover only this DP rank's shards.

    Every model chunk must be a DistributedDataParallel built with use_distributed_optimizer=True.
    overlap_param_gather: step() leaves the all-gather of the updated shards to the next forward,
    bucket by bucket (megafab.distributed.param_gather: zero_grad() dispatches each chunk's first
    bucket, forward pre-hooks dispatch the next and wait for their own); without it step()
    gathers every bucket before it returns.

    Expert params (`is_expert`, a MoE layer's routed experts) sit in buckets of their own that are
    reduce-scattered and all-gathered over expert-DP instead (data_parallel.py): expert-DP rank r
    owns shard s_r of each expert bucket, so their main params and Adam state are sharded over
    expert-DP (megatron-core's expert optimizer over intra_expt_dp_group); the other steps are the
    same, and the norm counts every rank's owned slices of either kind once (clip_grads.py).
    """

    shards_across_dp = True

    def __init__(self, model_chunks, *, overlap_param_gather: bool = False, **kwargs):
        chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
        bad = [i for i, c in enumerate(chunks)
               if not (isinstance(c, DistributedDataParallel) and c.use_distributed_optimizer)]
        if bad:
            raise OptimizerConfigError(
                f"the distributed optimizer needs every model chunk wrapped in "
                f"DistributedDataParallel(..., use_distributed_optimizer=True); chunk(s) {bad} are not")
        self.overlap_param_gather = overlap_param_gather
        super().__init__(chunks, **kwargs)

    def _build_entries(self, named) -> list[MainParam]:
        owned = {}
        for chunk in self.model_chunks:
            owned.update(owned_param_ranges(chunk))
        entries = []
        for name, p in named:
            if p not in owned:
                continue
            lo, hi = owned[p]
            if is_fp8_param(p):  # an fp32 (fp64 in fp64 models) master of the weight's init value
                dtype = torch.float32 if p.dtype in LOW_PRECISION else p.dtype
                main = main_start(p, dtype, lo, hi)
                entries.append(MainParam(name, p, main, not no_weight_decay(name, p), (lo, hi)))
                continue
            shard = p.detach().view(-1)[lo:hi]
            main = shard.float().clone() if p.dtype in LOW_PRECISION else shard
            entries.append(MainParam(name, p, main, not no_weight_decay(name, p), (lo, hi)))
        drop_init_values(p for chunk in self.model_chunks for p in chunk.parameters())
        return entries

    def param_shard_ranges(self) -> dict[str, tuple[int, int]]:
        """Per parameter name, the flat param-local range [lo, hi) whose main param and Adam state
        this rank holds (so a checkpoint can place them in the global, unsharded tensor)."""
        return {e.name: e.param_range for e in self.entries}

    def zero_grad(self):
        super().zero_grad()
        if self.overlap_param_gather:
            for chunk in self.model_chunks:
                chunk.param_gather.dispatch_first()

    def step(self):
        # Normally a no-op (each chunk's forward consumed its gathers); with no forward since
        # zero_grad() this lands the gathers before the optimizer writes the shards again.
        for chunk in self.model_chunks:
            chunk.finish_param_sync()
        return super().step()

    def _copy_main_to_model(self):
        super()._copy_main_to_model()
        for chunk in self.model_chunks:
            if self.overlap_param_gather:
                chunk.defer_param_sync()
            else:
                chunk.start_param_sync()
                chunk.finish_param_sync()

