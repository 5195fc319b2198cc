"""The optimizer of FSDP2 chunks (ZeRO-3): AdamW over each DP rank's local parameter shards.

FSDP2 keeps every parameter as a DTensor sharded on dim 0 over DP (megafab.distributed.fsdp), a
flat range [lo, hi) of its TP block like a distributed-optimizer shard; the optimizer steps the
local tensor of that shard with its local gradient shard (already reduce-scattered and averaged
over DP). For a bf16/fp16 model the shards are fp32, the master weights, stepped in place with no
copy; with CPU offload they stay in the model dtype and the host keeps the fp32 masters
(megafab.optim.cpu_offload); with --megatron-fsdp-main-params-dtype auto the 16-bit shards themselves
are the main params (no fp32 copy, 16-bit optimizer state). Norm, clipping, inf checks and the fp16
loss scaler are MixedPrecisionOptimizer's; shards are disjoint across DP (expert params' across
expert-DP).

Memory per parameter per rank (bf16 model, Adam): fp32 shard 4 + fp32 grad shard 4 + exp_avg 4 +
exp_avg_sq 4 = 16/d bytes at rest; the gathered 16-bit weights and the unsharded fp32 gradients of
the groups in use exist only during forward/backward. TE's FP8 weights (--fp8-param-gather) shard as
FP8 (TE's FSDP2 all-gather hooks gather uint8): 1/d byte + a fp32 main copy of the shard's init value,
cast back after each step with TE's cast_master_weights_to_fp8 (the amax reduced over DP).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megafab.distributed.fsdp import is_fully_sharded, local_tensor
from megafab.model.fp8_params import dequantized, drop_init_values, is_fp8_param, main_start
from megafab.optim.mixed_precision import (
    LOW_PRECISION,
    MainParam,
    MixedPrecisionOptimizer,
    OptimizerConfigError,
    no_weight_decay,
)


@dataclass
class ShardMainParam(MainParam):
    """A MainParam over the local shard of an FSDP2 DTensor parameter (flat, [lo, hi) of it)."""

    compute_dtype: torch.dtype | None = None

    def model_grad(self) -> torch.Tensor | None:
        grad = self.model_param.grad
        return None if grad is None else local_tensor(grad).view(-1)

    def model_values(self) -> torch.Tensor:
        local = local_tensor(self.model_param)
        return dequantized(local).view(-1) if self.fp8 else local.view(-1)

    @functools.cached_property
    def fp8(self) -> bool:
        return is_fp8_param(local_tensor(self.model_param))

    @property
    def model_dtype(self) -> torch.dtype:
        return self.compute_dtype


class FullyShardedOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer over FSDP2-sharded model chunks (see the module docstring)."""

    shards_across_dp = True

    def __init__(self, model_chunks, low_precision_main: bool = False, **kwargs):
        """low_precision_main: a 16-bit model's shards are the main params themselves (Megatron-FSDP's
        --megatron-fsdp-main-params-dtype auto): no fp32 copy, the optimizer state in their dtype."""
        self.low_precision_main = low_precision_main
        bad = [i for i, c in enumerate(model_chunks) if not is_fully_sharded(c)]
        if bad:
            raise OptimizerConfigError(f"the FSDP2 optimizer needs every model chunk wrapped in "
                                       f"FullyShardedDataParallel; chunk(s) {bad} are not")
        super().__init__(list(model_chunks), **kwargs)

    def _build_entries(self, named) -> list[MainParam]:
        owned, compute = {}, {}
        for chunk in self.model_chunks:
            owned.update(chunk.owned_param_ranges())
            compute.update({p: chunk.compute_dtype for p in chunk.params})
        entries = []
        for name, p in named:
            if p not in owned:
                continue
            local = local_tensor(p)
            if is_fp8_param(local):  # an fp32 (fp64 in fp64 models) master of the shard's init value
                dtype = torch.float32 if local.dtype in LOW_PRECISION else local.dtype
                main = main_start(p, dtype, *owned[p], local=local)
                entries.append(ShardMainParam(name, p, main, not no_weight_decay(name, p), owned[p],
                                              compute_dtype=compute[p]))
                continue
            shard = local.view(-1)
            main = shard.float().clone() if shard.dtype in LOW_PRECISION and not self.low_precision_main \
                else shard
            entries.append(ShardMainParam(name, p, main, not no_weight_decay(name, p), owned[p],
                                          compute_dtype=compute[p]))
        drop_init_values(p for chunk in self.model_chunks for p in chunk.parameters())
        if not entries:
            raise OptimizerConfigError(
                "this data-parallel rank holds no rows of any parameter under FSDP2 (more DP ranks "
                "than rows); use fewer data-parallel ranks or a larger model")
        return entries
