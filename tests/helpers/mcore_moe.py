"""megatron-core 0.16.1's MoELayer as the oracle for megafab's, on CPU, and the weight copy between
the two.

Workarounds for running megatron-core's MoE on CPU (tests only, never in megafab): its dispatchers
and shared experts create CUDA streams/events and ask for torch.cuda.current_device(); on gloo its
uneven all-gather (alltoall dispatcher at ETP > 1) runs as megafab's all-to-all form and its
all-to-all gets its splits as lists (gloo takes no tensors there); its router
gate calls Transformer Engine's GEMM by a module-level name that only exists with TE installed
(set to None, its own torch fallback runs); its RNG tracker fork is a no-op (no dropout here).
Its loss tracker keeps float32 values, so the router's calls to it are also recorded here at full
precision (LOGGED), which is what the float64 comparisons read; the tracker still gets them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import warnings

import torch
import torch.nn.functional as F

from megafab.model.activations import MLPActivation
from megafab.model.moe.layer import MoELayer
from megafab.model.moe.settings import MoESettings
from megafab.model.transformer import LayerContext

HIDDEN, FFN, LAYERS = 32, 48, 2
LOGGED: dict[str, torch.Tensor] = {}  # megatron-core router's logged losses, summed, full precision


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def record_event(self, *args):
        return types.SimpleNamespace(synchronize=lambda: None)


@contextlib.contextmanager
def megatron_moe_on_cpu(**parallel):
    """megatron-core's parallel_state (`parallel`: initialize_model_parallel's TP and expert
    sizes) over the process group the harness made, or a 1-rank fake group made here, and the CPU
    patches, undone after."""
    import pytest
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher

    track = router.save_to_aux_losses_tracker
    gather = mappings._gather_along_first_dim
    exchange = token_dispatcher.all_to_all

    def record(name, loss, *args, **kwargs):
        LOGGED[name] = LOGGED.get(name, 0) + loss.detach().double()
        track(name, loss, *args, **kwargs)

    def gather_uneven_on_gloo(x, group, output_split_sizes=None, *rest):  # gloo: equal all-gathers only
        if output_split_sizes is None or group.size() == 1:
            return gather(x, group, output_split_sizes, *rest)
        from megafab.distributed.mappings import gather_first_dim_uneven
        return gather_first_dim_uneven(x, list(output_split_sizes), group)

    def all_to_all_on_gloo(group, x, output_splits=None, input_splits=None):  # gloo: splits as lists
        as_list = (lambda splits: None if splits is None else [int(n) for n in splits])
        return exchange(group, x, as_list(output_splits), as_list(input_splits))

    patch = pytest.MonkeyPatch()
    # megatron-core's jit_fuser is torch.compile: compiling costs seconds per shape, and ranks forked
    # after inductor started in this process crash (SIGSEGV). Eager runs the same math.
    torch.compiler.set_stance("force_eager")
    patch.setattr(router, "save_to_aux_losses_tracker", record)
    patch.setattr(mappings, "_gather_along_first_dim", gather_uneven_on_gloo)
    patch.setattr(token_dispatcher, "all_to_all", all_to_all_on_gloo)
    patch.setattr(torch.cuda, "current_device", lambda: "cpu")
    patch.setattr(torch.cuda, "Stream", _Stream)
    patch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    patch.setattr(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    patch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    patch.setattr(mcore_random.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    own_group = not dist.is_initialized()
    if own_group:
        # torch's fake backend, not gloo: ranks forked after a gloo group lived in this process hang
        # building megatron's gloo groups. At one rank megatron-core bypasses every collective.
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(**{"tensor_model_parallel_size": 1, **parallel},
                                             create_gloo_process_groups=not own_group)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()  # the harness forks later tests from this process
        patch.undo()
        torch.compiler.set_stance("default")


# gpt-oss's experts: clamped quick-GEGLU with the +1 offset (the clamp small enough to bite here)
GPT_OSS_GLU = dict(quick_geglu=True, activation_func_clamp_value=0.05, glu_linear_offset=1.0)


def model_cfg(swiglu: bool, bias: bool = False, glu: dict | None = None):
    """The model fields MoELayer reads; `glu`: quick_geglu / activation_func_clamp_value /
    glu_linear_offset (default off)."""
    glu = {"quick_geglu": False, "activation_func_clamp_value": None, "glu_linear_offset": 0.0, **(glu or {})}
    return types.SimpleNamespace(hidden_size=HIDDEN, ffn_hidden_size=FFN, swiglu=swiglu, add_bias_linear=bias,
                                 init_method_std=0.02, num_layers=LAYERS, squared_relu=False,
                                 openai_gelu=False, **glu)


def megafab_layer(settings: MoESettings, swiglu: bool, dtype, bias: bool = False, per_token: bool = False,
                  seed: int = 5, tp_group=None, sequence_parallel: bool = False, glu: dict | None = None,
                  **groups) -> MoELayer:
    ctx = LayerContext(tp_group, sequence_parallel, dtype, torch.device("cpu"), seed)
    cfg = model_cfg(swiglu, bias, glu)
    return MoELayer(settings, cfg, ctx, "decoder.layers.0.mlp.",
                    activation=MLPActivation.from_model_config(cfg), calculate_per_token_loss=per_token,
                    **groups)


def megatron_activation(swiglu: bool, glu: dict | None = None) -> dict:
    """TransformerConfig's activation fields for megafab_layer's `swiglu` / `glu`."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    glu = glu or {}
    quick = glu.get("quick_geglu", False)
    return dict(gated_linear_unit=swiglu or quick,
                activation_func=quick_gelu if quick else F.silu if swiglu else F.gelu,
                activation_func_clamp_value=glu.get("activation_func_clamp_value"),
                glu_linear_offset=glu.get("glu_linear_offset", 0.0))


def megatron_layer(settings: MoESettings, swiglu: bool, dtype, bias: bool = False, per_token: bool = False,
                   layer_number: int = 1, fresh_logs: bool = True, glu: dict | None = None, **parallel):
    """megatron-core's MoELayer (local spec: SequentialMLP experts) with the same settings;
    `parallel`: TransformerConfig's parallel sizes (those given to megatron_moe_on_cpu)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    moe = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(settings).items()
           if k in fields and k not in ("moe_layer_freq", "moe_grouped_gemm")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
            num_moe_experts=settings.num_experts, use_cpu_initialization=True, params_dtype=dtype,
            gradient_accumulation_fusion=False, add_bias_linear=bias, bias_activation_fusion=False,
            calculate_per_token_loss=per_token, **megatron_activation(swiglu, glu), **parallel, **moe)
        spec = get_moe_module_spec(use_te=False, num_experts=settings.num_experts, moe_grouped_gemm=False)
        layer = build_module(spec, config=config, layer_number=layer_number)
    layer.set_layer_number(layer_number)
    if bias:  # at TP 1 / EP 1 its expert fc2 adds the bias in place into the identity "reduce"'s
        for expert in layer.experts.local_experts:  # output, which autograd forbids; skip that no-op
            expert.linear_fc2.explicit_expert_comm = True
    if fresh_logs:
        LOGGED.clear()
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    torch.manual_seed(0)
    with torch.no_grad():  # biases start at 0: give every tensor values
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return layer


def megafab_name(mcore_name: str, grouped: bool) -> tuple[str, int | None]:
    """megafab's parameter name for a megatron-core one, and the expert index into a grouped weight."""
    parts = mcore_name.split(".")
    if grouped and parts[:2] == ["experts", "local_experts"]:
        return "experts." + ".".join(parts[3:]), int(parts[2])
    return mcore_name, None


def megafab_view(ours: dict, mcore_name: str, grouped: bool) -> torch.Tensor:
    name, expert = megafab_name(mcore_name, grouped)
    tensor = ours[name]
    return tensor if expert is None else tensor[expert]


@torch.no_grad()
def copy_weights(mcore_layer, layer: MoELayer, grouped: bool) -> None:
    ours = dict(layer.named_parameters())
    for name, p in mcore_layer.named_parameters():
        megafab_view(ours, name, grouped).copy_(p)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(mcore_layer.router.expert_bias)


def megatron_losses() -> dict[str, float]:
    """megatron-core's logged losses (loss / coeff, summed over the forwards since the last call)."""
    values = {name: value.item() for name, value in LOGGED.items()}
    LOGGED.clear()
    return values


def set_megatron_loss_scale(scale: float) -> None:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(scale)
