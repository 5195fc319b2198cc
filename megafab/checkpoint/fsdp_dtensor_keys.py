"""megafab's checkpoint keys <-> Megatron-FSDP's fsdp_dtensor keys, box by box (fsdp_dtensor.py has the
schema).

A megafab parameter `name` (stored view, layout.py) is one or more fsdp_dtensor tensors: a routed
expert's [E, ...] is one tensor per global expert e, `mlp.experts.linear_fc1.weight<e>` (Transformer
Engine's grouped GEMM, --moe-grouped-gemm) or `mlp.experts.local_experts.<e>.linear_fc1.weight`
(SequentialMLP); SwiGLU's fc1 [.., 2, f, ..] is its gate `_w` and up `_v` halves [.., f, ..]. Each
piece is a view of the megafab box's view: translating copies nothing.
"""

from __future__ import annotations

import re

from megafab.checkpoint import megatron_keys as mk
from megafab.checkpoint.boxes import Box
from megafab.checkpoint.layout import Shard, strided_dim
from megafab.param_names import EXPERTS, LOCAL_EXPERTS, is_routed_expert, local_to_te_name, te_to_local_name

MODEL = "model."
WRAPPER = "module."
OPTIM_STATE = "optimizer.state."
GROUP_META = "optimizer.param_to_group_meta."
HALVES = ("_w", "_v")  # SwiGLU's gate and up halves of fc1
_WRAPPERS = re.compile(rf"^(?:{re.escape(WRAPPER)})+")
_GROUPED = re.compile(rf"^(.*\.{re.escape(EXPERTS)}linear_fc[12]\.(?:weight|bias))(\d+)$")
_SEQUENTIAL = re.compile(rf"^(.*\.){re.escape(LOCAL_EXPERTS)}(\d+)\.(.*)$")


def model_prefix(cfg) -> str:
    """The weights: MegatronFSDP's state_dict, `module.` (Float16Module's state_dict adds none)."""
    return MODEL + WRAPPER


def _param_wrappers(cfg) -> str:
    """The optimizer names parameters by the DDP wrapper's named_parameters: its `module.`,
    MegatronFSDP's `module.`, and Float16Module's `module.` for a 16-bit model."""
    return WRAPPER * (3 if cfg.precision.bf16 or cfg.precision.fp16 else 2)


def optim_prefix(cfg) -> str:
    return OPTIM_STATE + _param_wrappers(cfg)


def group_meta_prefix(cfg) -> str:
    return GROUP_META + _param_wrappers(cfg)


def module_path(name: str, cfg, expert: int | None = None, half: int | None = None) -> str:
    """The path Megatron's model has for megafab parameter `name` (expert `expert`, SwiGLU half)."""
    path = local_to_te_name(name) if cfg.model.transformer_impl == "transformer_engine" else \
        (te_to_local_name(name) or name)
    if expert is not None:
        path = path + str(expert) if cfg.moe.moe_grouped_gemm else \
            path.replace(EXPERTS, f"{LOCAL_EXPERTS}{expert}.", 1)
    return path + (HALVES[half] if half is not None else "")


def _split(items, dim: int):
    for tag, shape, box, view in items:
        o, n = box.offsets, box.sizes
        for i in range(o[dim], o[dim] + n[dim]):
            yield (*tag, i), (*shape[:dim], *shape[dim + 1:]), \
                Box((*o[:dim], *o[dim + 1:]), (*n[:dim], *n[dim + 1:])), view.select(dim, i - o[dim])


def pieces(name: str, shard: Shard, swiglu: bool):
    """((expert or None, half or None), fsdp_dtensor global shape, box, view) of every piece of a
    megafab Shard of parameter `name`."""
    items = [((), tuple(shard.global_shape), b, v) for b, v in zip(shard.boxes, shard.views)]
    expert = is_routed_expert(name)
    items = list(_split(items, 0)) if expert else [((None,), *rest) for _, *rest in items]
    dim = strided_dim(name, swiglu)
    if dim is None:
        return [((e, None), *rest) for (e,), *rest in items]
    return list(_split(items, dim - 1 if expert else dim))


def parse(key: str, transformer_engine: bool) -> tuple[str, str | None, int | None, int | None] | None:
    """(megafab name, optimizer kind or None, expert or None, SwiGLU half or None) of a stored
    tensor key; None for a key that holds no parameter state."""
    if key.startswith(MODEL):
        rest, kind = key[len(MODEL):], None
    elif key.startswith(OPTIM_STATE):
        rest, _, kind = key[len(OPTIM_STATE):].rpartition(".")
    else:
        return None
    rest = _WRAPPERS.sub("", rest)
    if rest.endswith("._extra_state"):
        return None
    half = expert = None
    for i, h in enumerate(HALVES):
        if rest.endswith(h) and ".linear_fc1." in rest:
            rest, half = rest[:-len(h)], i
    if m := _GROUPED.match(rest):
        rest, expert = m.group(1), int(m.group(2))
    elif m := _SEQUENTIAL.match(rest):
        rest, expert = m.group(1) + EXPERTS + m.group(3), int(m.group(2))
    return mk.megafab_name(rest, None, transformer_engine), kind, expert, half
