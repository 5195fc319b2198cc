"""FP8 parameters of the plain-torch TE stand-in (fake_te.py): Float8Tensor, a wrapper tensor
subclass holding uint8 raw data (real e4m3 bit patterns, torch.float8_e4m3fn) and a scale_inv;
quantized_model_init / fp8_model_init; and transformer_engine.pytorch.tensor.utils'
replace_raw_data, cast_master_weights_to_fp8 (TE's current-scaling path: each weight's amax
reduced with MAX over `group`, scale = 448 / amax, the master cast to the model dtype then
quantized into the weight's flat range) and post_all_gather_processing, with TE's signatures.
Any other op on a Float8Tensor runs on its dequantized values (as TE's fallback); copy_ into one
quantizes. A weight cast with manual_post_all_gather_processing=True is `stale` until
post_all_gather_processing ran on it, and the fake Linear refuses to compute with a stale weight."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

E4M3_MAX = 448.0
aten = torch.ops.aten


def _scale(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float()
    return torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))


def _to_e4m3(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scaled = (values.float() * scale).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


class Float8Tensor(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)
        self._data, self._scale_inv = data, scale_inv
        self.stale = [False]  # shared by the aliases of one weight
        return self

    @classmethod
    def quantize(cls, values: torch.Tensor) -> Float8Tensor:
        scale = _scale(values.abs().max())
        return cls(_to_e4m3(values, scale), (1.0 / scale).reshape(1), values.dtype)

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        values = self._data.view(torch.float8_e4m3fn).float() * self._scale_inv
        return values.to(dtype or self.dtype)

    def __repr__(self):
        return f"Float8Tensor({self.dequantize()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            alias = Float8Tensor(args[0]._data, args[0]._scale_inv, args[0].dtype)
            alias.stale = args[0].stale
            return alias
        if func is aten.copy_.default and isinstance(args[0], Float8Tensor):
            dst, src = args[0], args[1]
            src = src.dequantize() if isinstance(src, Float8Tensor) else src
            scale = _scale(src.abs().max())
            dst._data.copy_(_to_e4m3(src, scale))
            dst._scale_inv.copy_(1.0 / scale)
            return dst
        if func._schema.is_mutable and isinstance(args[0], Float8Tensor):
            raise RuntimeError(f"fake Float8Tensor: in-place {func} is not supported")
        unwrap = (lambda t: t.dequantize() if isinstance(t, Float8Tensor) else t)
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


QuantizedTensor = Float8Tensor
INIT = {"quantized": 0}


@contextlib.contextmanager
def quantized_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    INIT["quantized"] += enabled
    try:
        yield
    finally:
        INIT["quantized"] -= enabled


def weight(shape, dtype) -> torch.nn.Parameter:
    """A TE module's weight: an FP8 one inside quantized_model_init."""
    values = torch.zeros(shape, dtype=dtype)
    return torch.nn.Parameter(Float8Tensor.quantize(values) if INIT["quantized"] else values)


def usable(w) -> None:
    if isinstance(w, Float8Tensor) and w.stale[0]:
        raise RuntimeError("an FP8 weight was used before post_all_gather_processing after its cast")


def replace_raw_data(tensor, new_raw_data):
    assert isinstance(tensor, Float8Tensor), type(tensor)
    assert tensor._data.dtype == new_raw_data.dtype, "The data types of raw data don't match"
    new_raw_data.detach().copy_(tensor._data)
    tensor._data = new_raw_data


def cast_master_weights_to_fp8(model_weights, master_weights, start_offsets, group,
                               fsdp_shard_model_weights=None, manual_post_all_gather_processing=False):
    amaxes = torch.zeros(len(model_weights), dtype=torch.float32)
    for i, master in enumerate(master_weights):
        if master is not None:
            amaxes[i] = master.abs().max().float()
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    shards = fsdp_shard_model_weights or [None] * len(model_weights)
    for w, master, offset, amax, shard in zip(model_weights, master_weights, start_offsets, amaxes, shards):
        scale = _scale(amax)
        w._scale_inv.copy_(1.0 / scale)
        w.stale[0] = manual_post_all_gather_processing
        if master is None:
            continue
        target = shard if shard is not None else w._data.view(-1)[offset:offset + master.numel()]
        if isinstance(target, Float8Tensor):
            target = target._data
        target.view(-1).copy_(_to_e4m3(master.to(w.dtype), scale))


def post_all_gather_processing(model_weights):
    for w in model_weights:
        w.stale[0] = False
