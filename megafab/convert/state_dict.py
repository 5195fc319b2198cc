"""The full (TP=1, all layers) megafab state dict and the layout traps shared by every HF format.

A *full megafab state dict* maps megatron-core names with global layer numbers
(`decoder.layers.3.mlp.linear_fc1.weight`) to unsharded tensors shaped like the TP=1 GPTModel's
parameters: word embedding [V_padded, h], linear_qkv packed per key/value group, SwiGLU fc1
[2f, h] = [gate; up]. A tied output layer has no entry (it is the word embedding). Mixture-of-experts
layers hold their routed experts as one tensor per linear with the global expert axis first
(`mlp.experts.linear_fc1.weight` [E, 2f, h], the checkpoint's names: megafab.param_names),
whatever layout the model computes with.
"""

from __future__ import annotations

import torch

from megafab.checkpoint.vocab import padded_rows
from megafab.config import Config, ModelConfig
from megafab.config.derive import derive_model
from megafab.errors import MegafabError
from megafab.param_names import (  # noqa: F401 (OUTPUT_LAYER, WORD_EMBEDDING: the formats read them here)
    OUTPUT_LAYER,
    WORD_EMBEDDING,
    experts_name,
    is_moe_name,
    layer_prefix,
    parse_index,
    sequential_expert,
)
from megafab.plan.inventory import Inventory

POSITION_EMBEDDING = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm"


class ConversionError(MegafabError):
    """A model or file that cannot be converted; the message names the value, the rule and the fix."""


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q [heads*d, ...], k, v [groups*d, ...] -> [(heads + 2*groups)*d, ...] laid out per group as
    [q_1 .. q_{heads/groups}, k, v] (megatron-core). Works for weights [., h] and biases [.]."""
    rest = q.shape[1:]
    qg = q.reshape(groups, -1, *rest)  # [groups, heads/groups * d, ...]
    kg, vg = k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def unpack_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_qkv: (q [heads*d, ...], k [groups*d, ...], v [groups*d, ...])."""
    rest = qkv.shape[1:]
    d = qkv.shape[0] // (heads + 2 * groups)
    per_group = qkv.reshape(groups, (heads // groups + 2) * d, *rest)
    q_width = heads // groups * d
    q = per_group[:, :q_width].reshape(heads * d, *rest)
    k = per_group[:, q_width:q_width + d].reshape(groups * d, *rest)
    v = per_group[:, q_width + d:].reshape(groups * d, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def pad_vocab(weight: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """[V, h] -> [V_padded, h] by Megatron's padding rule (megafab.checkpoint.vocab: copies of the
    last row; generation reads only the first V logits, the loss all of them)."""
    if padded_vocab_size < weight.shape[0]:
        raise ConversionError(f"the embedding has {weight.shape[0]} rows but the padded vocabulary is only "
                              f"{padded_vocab_size}; the padded size must be at least the vocabulary size")
    return padded_rows(weight, padded_vocab_size)


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V_padded, h] -> [V, h]: the rows Megatron added for divisibility are dropped."""
    return weight[:vocab_size].contiguous()


def finalize_model_config(flat: dict, tp: int = 1) -> ModelConfig:
    """A ModelConfig from flat model fields with the derived sizes filled as Config.finalize does
    (without requiring the training fields a full validation needs)."""
    m = Config.from_flat(flat).model
    if m.num_query_groups is None:  # a checkpoint may record GQA without the group count
        m.num_query_groups = m.num_attention_heads
    if m.seq_length is None:
        m.seq_length = m.max_position_embeddings
    derive_model(m, tp)
    return m


def expected_keys(m: ModelConfig, moe=None) -> set[str]:
    """Every key a full megafab state dict of this model has (moe: cfg.moe of a mixture-of-experts
    model): the state-dict keys of the one-process model the engine builds (megafab.plan.inventory),
    routed experts under their checkpoint names; a tied output layer has none."""
    inv = Inventory(m, moe)
    keys = {experts_name(k) for k in inv.ends(True, True).keys}
    for i in range(m.num_layers):
        keys.update(experts_name(k) for k in inv.named_layer(i).keys)
    return keys


def moe_keys(m: ModelConfig, moe) -> list[str]:
    """The layer-relative keys of an MoE layer's MLP in a full state dict: the router, the routed
    experts under their grouped names [E, out, in] (param_names.py), the shared experts."""
    inv = Inventory(m, moe)
    index = next(i for i in range(m.num_layers) if inv.layer(i).expert)
    suffixes = (parse_index(experts_name(k))[1] for k in inv.named_layer(index).keys)
    return list(dict.fromkeys(k for k in suffixes if is_moe_name(k)))


def module_state_dict(sd: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """The full state dict under a one-process module's own names `names` (its state_dict keys):
    a SequentialMLP expert `...local_experts.<i>.linear_fc1.weight` takes row i of the stacked
    `...experts.linear_fc1.weight`; every other name is its own key (views, no copies)."""
    out = {}
    for name in names:
        sequential = sequential_expert(name)
        out[name] = sd[name] if sequential is None else sd[sequential[1]][sequential[0]]
    return out


def layer_norm_names(m: ModelConfig) -> list[str]:
    """The norms inside one layer (layer-relative names)."""
    qk = ["self_attention.q_layernorm", "self_attention.k_layernorm"] if m.qk_layernorm else []
    return ["input_layernorm", "pre_mlp_layernorm", *qk]


def plain_norm_weights(sd: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """The state dict with ordinary norm weights: a --apply-layernorm-1p model stores gamma - 1 and
    computes with weight + 1, so its equivalent plain weight is weight + 1 (the same fp32 value the
    model computes with)."""
    if not m.apply_layernorm_1p:
        return sd
    norms = {FINAL_NORM + ".weight"} | {layer_prefix(i) + n + ".weight" for i in range(m.num_layers)
                                         for n in layer_norm_names(m)}
    return {k: (v + 1 if k in norms else v) for k, v in sd.items()}


def hf_variant_problems(m: ModelConfig, architecture: str) -> list[str]:
    """Model variants a HF GPT-2 / Llama config cannot express (they have no such weights)."""
    out = []
    if m.qk_layernorm:
        out.append(f"--qk-layernorm (q_layernorm / k_layernorm weights: HF {architecture} has no q/k norms)")
    if m.apply_residual_connection_post_layernorm:
        out.append(f"--apply-residual-connection-post-layernorm (HF {architecture} adds the residual "
                   f"before the norm)")
    if m.window_size is not None and m.window_size[0] >= 0:
        out.append(f"--window-size {m.window_size} (HF {architecture} attends over the whole context)")
    if m.softmax_type != "vanilla":
        out.append(f"--softmax-type {m.softmax_type} (HF {architecture} has no attention sinks)")
    if m.rotary_interleaved:
        out.append(f"--rotary-interleaved (HF {architecture} rotates channel i with i + d/2)")
    return out


def check_keys(state_dict: dict, expected: set[str], what: str) -> None:
    missing, extra = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or extra:
        raise ConversionError(
            f"{what} does not match its config: missing {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
            f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}; the weights and config.json must "
            f"come from the same model")
