"""Optimizers: fp32 main params, the distributed optimizer, loss scalers, clipping, LR schedule."""

from megafab.optim.distributed_optimizer import DistributedOptimizer, owned_param_ranges
from megafab.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megafab.optim.lr_scheduler import OptimizerParamScheduler
from megafab.optim.memory import MemoryReport, measure_memory
from megafab.optim.mixed_precision import (
    MixedPrecisionOptimizer,
    NonFiniteGradError,
    OptimizerConfigError,
)

__all__ = ["ConstantGradScaler", "DistributedOptimizer", "DynamicGradScaler", "MemoryReport",
           "MixedPrecisionOptimizer", "NonFiniteGradError", "OptimizerConfigError",
           "OptimizerParamScheduler", "measure_memory", "owned_param_ranges"]
