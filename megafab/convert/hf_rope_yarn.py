"""HF's rope_parameters with rope_type yarn (or default) <-> megafab's YaRN fields (model/rotary.py).

transformers (modeling_rope_utils._compute_yarn_parameters) and megatron-core compute the same
frequencies: factor = --rotary-scaling-factor (HF: max_position_embeddings / original when absent),
original_max_position_embeddings, beta_fast / beta_slow (0 or absent: 32 / 1), truncate =
--yarn-correction-range-round-to-int. They differ in the factor on cos and sin: HF takes
yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) only when both are nonzero and
yarn_mscale(factor) otherwise, megatron-core always the former. So mscale_all_dim 0 imports as
mscale 1 (what HF computes), and mscale 0 with mscale_all_dim set, or an explicit attention_factor,
is refused. The softmax scale yarn_mscale(factor, mscale_all_dim)^2 (HF's yarn_apply_mscale, MLA
only) is the same on both sides.
"""

from __future__ import annotations

from megafab.convert.state_dict import ConversionError
from megafab.model.rotary import Yarn, rope_kind

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "truncate")


def _rope_parameters(c: dict) -> dict:
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    return rope


def from_hf(c: dict) -> dict:
    """megafab's fields of a config.json's RoPE: rope_type ("rope" or "yarn"), rotary_base and, for
    yarn, the YaRN values; one ConversionError naming the field for what megafab cannot reproduce."""
    rope = _rope_parameters(c)
    kind = rope.pop("rope_type", None) or "default"
    theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise ConversionError(f"config.json rope_theta {theta} is not an integer; megafab's --rotary-base is "
                              f"an int; megafab cannot import this model exactly")
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    out = dict(rope_type="rope", rotary_base=int(theta), rotary_percent=1.0)
    if kind == "yarn":
        original = rope.pop("original_max_position_embeddings", c["max_position_embeddings"])
        factor = rope.pop("factor", None) or c["max_position_embeddings"] / original
        mscale, mscale_all_dim = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
        if mscale_all_dim and not mscale:
            raise ConversionError(f"config.json rope_parameters mscale {mscale!r} with mscale_all_dim "
                                  f"{mscale_all_dim}: transformers then scales cos and sin by "
                                  f"yarn_mscale(factor) alone, megatron-core's YaRN divides by "
                                  f"yarn_mscale(factor, mscale_all_dim); megafab cannot import this model "
                                  f"exactly")
        out.update(rope_type="yarn", rotary_scaling_factor=float(factor),
                   yarn_original_max_position_embeddings=int(original),
                   yarn_beta_fast=float(rope.pop("beta_fast", None) or 32.0),
                   yarn_beta_slow=float(rope.pop("beta_slow", None) or 1.0),
                   mscale=float(mscale) if mscale_all_dim else 1.0,
                   mscale_all_dim=float(mscale_all_dim or 0.0),
                   yarn_correction_range_round_to_int=bool(rope.pop("truncate", True)))
    elif kind != "default":
        raise ConversionError(f"config.json rope_parameters rope_type {kind!r}: megafab's multi-latent "
                              f"attention takes rope_type default or yarn; megafab cannot import this model "
                              f"exactly")
    if rope:
        extra = ", ".join(f"{k}={v!r}" for k, v in rope.items())
        raise ConversionError(f"config.json rope_parameters {kind} has {extra}, which megafab does not "
                              f"reproduce (its YaRN takes {', '.join(_YARN_KEYS)}); megafab cannot import "
                              f"this model exactly")
    return out


def export_problems(m) -> list[str]:
    """What HF's rope_parameters cannot express of a multi-latent attention model `m`."""
    if rope_kind(m) == "rope":
        if m.rotary_scaling_factor > 1 and m.mscale_all_dim:
            return [f"--rope-type rope with --rotary-scaling-factor {m.rotary_scaling_factor} and "
                    f"--mscale-all-dim {m.mscale_all_dim} (megatron-core's MLA scales its softmax by YaRN's "
                    f"mscale even without YaRN; HF does only with rope_type yarn)"]
        return []
    yarn = Yarn.from_model_config(m)
    ignored = yarn.mscale != 1 if not yarn.mscale_all_dim else not yarn.mscale
    if yarn.scale > 1 and ignored:
        return [f"--mscale {yarn.mscale} with --mscale-all-dim {yarn.mscale_all_dim} (HF ignores mscale "
                f"unless both are nonzero)"]
    return []


def to_hf(m) -> dict:
    """HF's rope_parameters of a multi-latent attention model config `m` (export_problems: none)."""
    if rope_kind(m) == "rope":
        return {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    yarn = Yarn.from_model_config(m)
    return {"rope_type": "yarn", "rope_theta": float(m.rotary_base), "factor": yarn.scale,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim, "truncate": yarn.round_to_int}
