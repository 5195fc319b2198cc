"""The distributed optimizer (ZeRO-1, Megatron's `--use-distributed-optimizer`).

Data flow of one step, per DP rank r of DP ranks d (with context parallelism "DP" here is the
DP x CP group, d = dp * cp, as Megatron's: CP ranks hold the same parameters):

    grad buffer (fp32)  [ bucket 0: s0 | s1 | .. | s(d-1) ][ bucket 1: s0 | .. ] ...
                                    ^ rank r owns shard s_r of every bucket
    1. backward fills the buffer; DDP reduce-scatters each bucket -> s_r holds the DP-mean grad
    2. for every param overlapping s_r, its fp32 main shard takes that slice of grad
    3. norm / clip / inf check on the owned slices, reduced over DP and model parallel
    4. AdamW steps the owned main shards (exp_avg, exp_avg_sq exist only for them)
    5. the main shards are written into the param buffer (model dtype) and every bucket is
       all-gathered over DP, so every rank again holds all parameters

Expert params (`is_expert`, a MoE layer's routed experts) sit in buckets of their own that are
reduce-scattered and all-gathered over expert-DP instead (data_parallel.py): expert-DP rank r owns
shard s_r of each expert bucket, so their main params and Adam state are sharded over expert-DP
(megatron-core's expert optimizer over intra_expt_dp_group); steps 2-5 are the same for them, and
the norm of step 3 counts every rank's owned slices of either kind once (optim/clip_grads.py).

Memory per parameter (bf16 model, fp32 grads), Megatron's table: weights 2 + grads 4 bytes,
unsharded; fp32 main param 4 + Adam exp_avg 4 + exp_avg_sq 4 = 12 bytes sharded over d:
6 + 12/d bytes per parameter (18 without the distributed optimizer). For fp32 models the main
shard is a view of the param buffer (no copy), so the sharded part is 8/d.
"""

from __future__ import annotations

from torch import nn

from megafab.distributed.data_parallel import DistributedDataParallel
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
            shard = p.detach().view(-1)[lo:hi]
            main = shard.float().clone() if p.dtype in LOW_PRECISION else shard
            entries.append(MainParam(name, p, main, not no_weight_decay(name, p), (lo, hi)))
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

