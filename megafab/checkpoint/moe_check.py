"""Whether a checkpoint's model is the mixture of experts this run builds (or a dense one), said in
one message naming what the checkpoint holds, before any tensor is read.

The checkpoint's args are compared first (megatron_args: --num-experts and the MoE sizes); this
check covers checkpoints without args (a bare dist_checkpointing.save) and args that disagree with
the tensors: it reads the stored tensors' names and the expert count off the experts' global axis.
"""

from __future__ import annotations

from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import MODEL_PREFIX, split_key
from megafab.param_names import is_routed_expert, layer_of


def moe_layers(shapes: dict) -> dict[int, int]:
    """Layer -> routed experts of each MoE layer, from model.* key -> global shape (a checkpoint's
    metadata sizes or a model's Shards)."""
    out = {}
    for key, shape in shapes.items():
        if not key.startswith(MODEL_PREFIX):
            continue
        name, _ = split_key(key)
        if is_routed_expert(name) and layer_of(name) is not None:
            out[layer_of(name)] = int(shape[0])
    return out


def describe(layers: dict[int, int]) -> str:
    if not layers:
        return "a dense model (no routed experts)"
    counts = sorted(set(layers.values()))
    experts = " / ".join(str(c) for c in counts)
    which = sorted(layers)
    return (f"a mixture-of-experts model with {experts} experts in layer{'s' if len(which) > 1 else ''} "
            f"{', '.join(str(n) for n in which)}")


def check_moe_matches(stored: dict, wanted: dict, path: str) -> None:
    """stored: model.* key -> metadata with .size (the checkpoint); wanted: key -> global shape (this
    run's Shards: a pipeline stage's own layers). One CheckpointError when the MoE layers or their
    expert counts differ in the layers this rank builds."""
    have = moe_layers({k: tuple(md.size) for k, md in stored.items() if hasattr(md, "size")})
    want = moe_layers(wanted)
    built = {layer_of(split_key(k)[0]) for k in wanted if k.startswith(MODEL_PREFIX)}
    if {n: e for n, e in have.items() if n in built} != want:
        raise CheckpointError(
            f"{path} holds {describe(have)}, but this run builds {describe(want)}; pass the checkpoint's "
            f"--num-experts / --moe-layer-freq (or load a checkpoint of this model)")
