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
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, stale=None):
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=dtype,
                                                   device=data.device)
        self._data, self._scale_inv = data, scale_inv
        self.stale = stale or [False]  # shared by the views of one weight
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

    # FSDP2's all-gather extension (TE's Float8Tensor has one): the uint8 data travels, the scale
    # rides along as metadata (every rank's is the same: cast_master_weights_to_fp8 reduces the amax)
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._data.contiguous(),), (self._scale_inv.clone(),)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,), (scale_inv,) = all_gather_outputs, metadata
        if out is not None:
            out._scale_inv.copy_(scale_inv)
            return None
        return Float8Tensor(data, scale_inv, self.dtype), (data,)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in VIEWS:  # views of the raw data, sharing the scale
            t = args[0]
            out = func(t._data, *args[1:], **kwargs)
            wrap = (lambda d: Float8Tensor(d, t._scale_inv, t.dtype, t.stale))
            return [wrap(d) for d in out] if isinstance(out, (list, tuple)) else wrap(out)
        if func is aten.new_zeros.default:
            t, size = args[0], args[1]
            return Float8Tensor(torch.zeros(size, dtype=torch.uint8, device=t.device), t._scale_inv.clone(),
                                t.dtype)
        if func is aten.copy_.default and isinstance(args[0], Float8Tensor):
            dst, src = args[0], args[1]
            if isinstance(src, Float8Tensor):  # raw bytes and scale (FSDP2's sharding)
                dst._data.copy_(src._data)
                dst._scale_inv.copy_(src._scale_inv)
                return dst
            scale = _scale(src.abs().max())
            dst._data.copy_(_to_e4m3(src, scale))
            dst._scale_inv.copy_(1.0 / scale)
            return dst
        if func._schema.is_mutable and isinstance(args[0], Float8Tensor):
            raise RuntimeError(f"fake Float8Tensor: in-place {func} is not supported")
        unwrap = (lambda t: t.dequantize() if isinstance(t, Float8Tensor) else t)
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


QuantizedTensor = Float8Tensor
VIEWS = {aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
         aten.slice.Tensor, aten.narrow.default, aten.as_strided.default, aten.split.Tensor,
         aten.split_with_sizes.default, aten.chunk.default}
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
