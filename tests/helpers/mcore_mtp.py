"""megatron-core 0.16.1's multi-token prediction as the oracle in the tests: the test-only shims and
the settings the MTP oracle tests share. megatron-core's vocab-parallel cross entropy upcasts the
logits to float32, so at one rank it is replaced by the exact one (float64 comparisons); the logits
every output-layer call makes (each MTP depth's, then the main ones) are recorded by wrapping."""

from __future__ import annotations

import torch.nn.functional as F

SCALE = 0.75  # the MTP losses' backward weight (grad scale / micro-batches in training)
FACTOR = 0.3  # --mtp-loss-scaling-factor
# DeepSeek-V3's MoE in small: a dense first layer, an MoE last layer (so the MTP layer is MoE too),
# a shared expert, sigmoid group-limited routing with the expert bias
MOE = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1), moe_ffn_hidden_size=24,
           moe_shared_expert_intermediate_size=40, moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
           moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)


def exact_cross_entropy(logits, labels, label_smoothing=0.0):
    """megatron-core's vocab_parallel_cross_entropy at one rank without its float32 upcast."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


def recording(fn, into: list):
    """fn, appending each call's output (its first element, for a linear's (output, bias)) to `into`."""
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        into.append((out[0] if isinstance(out, tuple) else out).detach())
        return out
    return wrapped
