"""FP8 parameters (--fp8-param-gather): TE's linear weights stored as FP8 tensors, gathered in FP8.

UNVERIFIED: transformer_engine was not installable where this was written; this follows TE's
documented API (transformer_engine.pytorch.quantized_model_init, fp8_model_init before TE 2.9;
QuantizedTensor.dequantize; transformer_engine.pytorch.tensor.utils.replace_raw_data,
cast_master_weights_to_fp8 (TE >= 2.2; under FSDP2 given the local FP8 shards) and
post_all_gather_processing (TE >= 2.10; absent: a no-op, the transpose is made in the next forward)),
as megatron-core's fp8_utils uses it. On CPU it runs through tests/helpers/fake_te.py.

Data flow with the distributed optimizer (data_parallel.py, distributed_optimizer.py): an FP8
weight's raw uint8 data is a view of its bucket's uint8 parameter buffer (1 byte per parameter), its
fp32 main shard starts from the dequantized values, and after a step every rank casts its main
shards into its shards of that buffer (the amax reduced over the bucket's group, so every rank
computes the same scale), the buckets are all-gathered as uint8 and TE's post-all-gather processing
runs. Under FSDP2 (distributed/fsdp.py, optim/fully_sharded_optimizer.py) the FP8 weights shard as
FP8 (TE >= 2.10's fsdp_pre/post_all_gather hooks gather the uint8 data), each rank's fp32 mains cast into
its local shards the same way. Checkpoints hold the weights dequantized, in the model dtype (as
megatron-core's torch_dist), and a resume casts the checkpoint's main params again.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch

from megafab.errors import MegafabError


def _te_tensor_utils():
    from transformer_engine.pytorch.tensor import utils  # deferred: TE is a CUDA-only install

    return utils


def is_fp8_param(param) -> bool:
    """A TE quantized (FP8) tensor: QuantizedTensor (TE >= 2.0), or Float8Tensor before it."""
    if "transformer_engine" not in sys.modules:  # no TE imported: no TE tensor exists
        return False
    try:
        from transformer_engine.pytorch.tensor import QuantizedTensor as fp8_class
    except ImportError:
        try:
            from transformer_engine.pytorch.float8_tensor import Float8Tensor as fp8_class
        except ImportError:
            return False
    return isinstance(param, fp8_class)


def quantized_init_context(precision_cfg, recipe_fn):
    """TE's quantized_model_init (fp8_model_init before TE renamed it) with --fp8-param-gather: the
    TE modules built inside keep their weights as FP8 tensors; a no-op otherwise."""
    if precision_cfg is None or not getattr(precision_cfg, "fp8_param_gather", False):
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te  # deferred: TE is a CUDA-only install

    try:
        _te_tensor_utils().cast_master_weights_to_fp8  # noqa: B018 (what every step needs, TE >= 2.2)
    except (ImportError, AttributeError):
        raise MegafabError(f"--fp8-param-gather needs Transformer Engine >= 2.2 (its tensor.utils."
                           f"cast_master_weights_to_fp8); this is TE {getattr(te, '__version__', '?')}: "
                           f"upgrade transformer_engine or drop --fp8-param-gather") from None
    init = getattr(te, "quantized_model_init", None) or te.fp8_model_init
    return init(enabled=True, recipe=recipe_fn(precision_cfg))


def dequantized(param, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values of an FP8 parameter as a plain tensor (its nominal dtype unless `dtype`)."""
    return param.dequantize(dtype=dtype or param.dtype)


INIT_VALUE = "megafab_init_value"  # an FP8 weight's value before quantization, until the mains exist


def initialize_weight(param, value: torch.Tensor) -> None:
    """param.copy_(value) (an FP8 weight quantizes it); an FP8 weight also keeps `value` in its
    nominal dtype until the optimizer's mains start from it (Megatron's
    preserve_high_precision_init_val: the masters are not the FP8 rounding of the init)."""
    with torch.no_grad():
        param.copy_(value.to(param.dtype))
    if is_fp8_param(param):
        setattr(param, INIT_VALUE, value.detach().to(param.dtype).clone())


def main_start(param, dtype: torch.dtype, lo: int, hi: int, local=None) -> torch.Tensor:
    """The fp32 (fp64) main of the flat range [lo, hi) of FP8 weight `param`'s TP block: its kept
    init value there, else the dequantized weight's (`local`: FSDP2's FP8 shard, exactly that range)."""
    init = getattr(param, INIT_VALUE, None)
    if init is not None:
        return init.reshape(-1)[lo:hi].to(dtype).clone()
    if local is None:
        return dequantized(param, dtype).view(-1)[lo:hi].clone()
    assert local.numel() == hi - lo, "an FSDP2 shard holds exactly its owned range"
    return dequantized(local, dtype).view(-1).clone()


def drop_init_values(params) -> None:
    """The mains exist: the kept init values are freed (Megatron's clear_high_precision_init_val)."""
    for p in params:
        if hasattr(p, INIT_VALUE):
            delattr(p, INIT_VALUE)


def raw_tensors(param) -> list[torch.Tensor]:
    """The plain tensors an FP8 parameter keeps (its uint8 data, TE's transpose / column-wise copy
    where it holds one), for memory accounting."""
    names = ("_data", "_transpose", "_rowwise_data", "_columnwise_data", "_scale_inv")
    return [t for t in (getattr(param, n, None) for n in names) if isinstance(t, torch.Tensor)]


def replace_raw_data(param, buffer_view: torch.Tensor) -> None:
    """Make `param`'s raw FP8 data `buffer_view` (uint8, param-shaped), its values kept."""
    _te_tensor_utils().replace_raw_data(param, buffer_view.view(param.shape))


def cast_masters(params: list, mains: list, offsets: list, group,
                 manual_post_processing: bool = True) -> None:
    """TE's cast_master_weights_to_fp8 over every FP8 parameter of a group's buckets (or FSDP2's
    local shards), on every rank of `group` (the amax reduction is collective): mains[i] (or None
    where this rank owns none of params[i]) is written into params[i]'s flat range starting at
    offsets[i]. manual_post_processing: post_all_gather() runs after the gather (the distributed
    optimizer's); FSDP2's gather runs TE's own fsdp_post_all_gather."""
    if not params:
        return
    utils = _te_tensor_utils()
    kwargs = {}
    accepted = inspect.signature(utils.cast_master_weights_to_fp8).parameters
    if manual_post_processing and getattr(utils, "post_all_gather_processing", None) is not None and \
            "manual_post_all_gather_processing" in accepted:
        kwargs["manual_post_all_gather_processing"] = True  # post_all_gather() runs after the gather
    utils.cast_master_weights_to_fp8(params, mains, offsets, group, **kwargs)


def post_all_gather(params: list) -> None:
    """TE's processing of gathered FP8 weights (transpose / column-wise data); older TE: none."""
    process = getattr(_te_tensor_utils(), "post_all_gather_processing", None)
    if params and process is not None:
        process(params)
