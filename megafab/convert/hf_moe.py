"""What HF's mixture-of-experts models share (Mixtral, Qwen3-MoE) <-> megafab: the router's
semantics as megatron-core flags, and the experts as the full state dict's stacked tensors.

Router. HF computes probs = softmax(logits) over every expert (in fp32), takes the top k, and with
Mixtral (and Qwen3-MoE's norm_topk_prob true) divides them by their sum. Dividing softmax values
by their sum over the chosen set is the softmax over the chosen logits, and the top k of the
softmax are the top k logits, so that is megatron-core's default router: top-k of the logits, then
softmax over those k (moe_router_pre_softmax false). Qwen3-MoE's norm_topk_prob false keeps the
full softmax's values unrenormalized: megatron-core's --moe-router-pre-softmax. Both use softmax
scores, no expert bias, no group routing, no top-k scaling; HF's softmax runs in fp32, as megatron-core's
with --moe-router-dtype fp32 (what an import sets).

Experts. HF keeps one gate/up/down linear per expert (Mixtral w1/w3/w2); megafab's full state dict
one tensor per linear with the expert axis first (convert/state_dict.py): fc1 [E, 2f, h] =
[gate_e; up_e] per expert, fc2 [E, h, f].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megafab.convert import hf_llama
from megafab.convert.state_dict import ConversionError, check_keys, expected_keys, plain_norm_weights
from megafab.param_names import EXPERTS, ROUTER, layer_prefix
from megafab.progress import progress

HF_LAYERS = hf_llama.HF_LAYERS


def router_settings(norm_topk_prob: bool) -> dict:
    """The cfg.moe router fields that compute HF's routing."""
    return dict(moe_router_score_function="softmax", moe_router_pre_softmax=not norm_topk_prob,
                moe_router_dtype="fp32", moe_router_enable_expert_bias=False,
                moe_router_topk_scaling_factor=None, moe_router_num_groups=None, moe_router_group_topk=None)


def norm_topk_prob(moe) -> bool:
    """Inverse of router_settings: whether the chosen probabilities are renormalized."""
    return not moe.moe_router_pre_softmax


def export_problems(m, moe, architecture: str) -> list[str]:
    """The MoE features a HF `architecture` config cannot express (one line each)."""
    out = []
    if moe.moe_router_score_function != "softmax":
        out.append(f"--moe-router-score-function {moe.moe_router_score_function} (HF {architecture} routes "
                   f"by softmax)")
    if moe.moe_router_load_balancing_type == "sinkhorn":  # eval: the unnormalised scores at the top k
        out.append(f"--moe-router-load-balancing-type sinkhorn (its experts are weighted by sigmoid at "
                   f"top-1, by the softmax over all experts above; HF {architecture} renormalises)")
    for flag, value in (("--moe-router-enable-expert-bias", moe.moe_router_enable_expert_bias),
                        ("--moe-router-topk-scaling-factor", moe.moe_router_topk_scaling_factor),
                        ("--moe-router-group-topk", moe.moe_router_group_topk),
                        ("--moe-shared-expert-intermediate-size", moe.moe_shared_expert_intermediate_size),
                        ("--add-bias-linear", m.add_bias_linear)):
        if value:
            out.append(f"{flag} {value} (HF {architecture} has no such weights or routing)")
    return out


def hf_expert_keys(root: str, num_experts: int, names: tuple[str, str, str]) -> list[str]:
    """The per-expert HF names under `root` (e.g. `block_sparse_moe.experts.`), names (gate, up, down)."""
    return [layer_prefix(e, root) + n for e in range(num_experts) for n in names]


def experts_from_hf(hf: dict, src: str, root: str, num_experts: int,
                    names: tuple[str, str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1 [E, 2f, h], fc2 [E, h, f]) of the layer at prefix `src`."""
    gate, up, down = ([hf[src + layer_prefix(e, root) + n] for e in range(num_experts)] for n in names)
    fc1 = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
    return fc1, torch.stack(down)


def experts_to_hf(fc1: torch.Tensor, fc2: torch.Tensor, dst: str, root: str,
                  names: tuple[str, str, str]) -> dict:
    """Inverse of experts_from_hf."""
    out = {}
    for e in range(fc1.shape[0]):
        gate, up = fc1[e].chunk(2, dim=0)
        prefix = dst + layer_prefix(e, root)
        out.update({prefix + names[0]: gate.contiguous(), prefix + names[1]: up.contiguous(),
                    prefix + names[2]: fc2[e].contiguous()})
    return out


def moe_layer_from_hf(hf: dict, src: str, dst: str, router: str, root: str, num_experts: int,
                      names: tuple[str, str, str]) -> dict:
    """One MoE layer's router and experts, HF (prefix src) -> megafab (prefix dst)."""
    fc1, fc2 = experts_from_hf(hf, src, root, num_experts, names)
    return {dst + ROUTER + "weight": hf[src + router], dst + EXPERTS + "linear_fc1.weight": fc1,
            dst + EXPERTS + "linear_fc2.weight": fc2}


def moe_layer_to_hf(sd: dict, src: str, dst: str, router: str, root: str,
                    names: tuple[str, str, str]) -> dict:
    """Inverse of moe_layer_from_hf."""
    out = {dst + router: sd[src + ROUTER + "weight"]}
    out.update(experts_to_hf(sd[src + EXPERTS + "linear_fc1.weight"], sd[src + EXPERTS + "linear_fc2.weight"],
                             dst, root, names))
    return out


def refuse_sliding_window(c: dict, architecture: str) -> None:
    window = c.get("sliding_window")
    uses = c.get("use_sliding_window", window is not None)
    if uses and window is not None and window < c["max_position_embeddings"]:
        raise ConversionError(f"config.json sliding_window {window}: HF {architecture} then attends to the "
                              f"last {window} positions only; megafab's attention is full causal attention")


@dataclass(frozen=True)
class Family:
    """A Llama-attention MoE architecture's names: `router` (the gate's weight), the experts'
    `root` and their (gate, up, down) `names`; dense layers are Llama's MLP. check_exportable(m, moe)
    raises for what the architecture cannot express."""

    architecture: str
    router: str
    root: str
    names: tuple[str, str, str]
    check_exportable: Callable

    def layer_keys(self, m, moe, i: int) -> list[str]:
        mlp = ([self.router, *hf_expert_keys(self.root, moe.num_experts, self.names)] if moe.is_moe_layer(i)
               else list(hf_llama.DENSE_MLP))
        return [*hf_llama.attention_hf_names(m), *mlp]

    def hf_expected_keys(self, m, moe) -> set[str]:
        keys = hf_llama.hf_base_keys(m)
        for i in range(m.num_layers):
            keys.update(layer_prefix(i, HF_LAYERS) + n for n in self.layer_keys(m, moe, i))
        return keys

    def to_hf_state_dict(self, sd: dict, m, moe) -> dict:
        """Full megafab state dict -> the HF model's (no lm_head when tied)."""
        self.check_exportable(m, moe)
        check_keys(sd, expected_keys(m, moe), "the megafab state dict")
        sd = plain_norm_weights(sd, m)
        out = hf_llama.base_to_hf(sd, m)
        for i in progress(range(m.num_layers), desc=f"export to HF {self.architecture}", unit="layer"):
            src, dst = layer_prefix(i), layer_prefix(i, HF_LAYERS)
            out.update(hf_llama.attention_to_hf(sd, src, dst, m))
            moe_layer = moe.is_moe_layer(i)
            out.update(moe_layer_to_hf(sd, src, dst, self.router, self.root, self.names) if moe_layer
                       else hf_llama.dense_mlp_to_hf(sd, src, dst))
        return out

    def from_hf_state_dict(self, hf: dict, m, moe) -> dict:
        """The HF model's state dict -> full megafab state dict (vocabulary padded)."""
        hf = hf_llama.hf_weights(hf, m)
        check_keys(hf, self.hf_expected_keys(m, moe), f"the HF {self.architecture} weights")
        sd = hf_llama.base_from_hf(hf, m)
        for i in progress(range(m.num_layers), desc=f"import from HF {self.architecture}", unit="layer"):
            src, dst = layer_prefix(i, HF_LAYERS), layer_prefix(i)
            sd.update(hf_llama.attention_from_hf(hf, src, dst, m))
            sd.update(moe_layer_from_hf(hf, src, dst, self.router, self.root, moe.num_experts, self.names)
                      if moe.is_moe_layer(i) else hf_llama.dense_mlp_from_hf(hf, src, dst))
        return sd
