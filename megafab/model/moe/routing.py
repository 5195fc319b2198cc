"""Top-k routing as pure tensor functions: gate logits, scores, the top-k choice, capacity.

Shapes: N tokens (s * b of this rank), E experts. A routing is a pair
    probs        [N, E]  the weight of each chosen expert (0 elsewhere)
    routing_map  [N, E]  bool, True where the token goes to the expert

Numerics follow megatron-core 0.16.1: the softmax scores are computed in float32 and cast back to
the logits' dtype (also when the router runs in fp64), sigmoid scores likewise from float32 logits.
"""

from __future__ import annotations

import math

import torch


class _GateLinear(torch.autograd.Function):
    """logits = x W^T (+ b) in `dtype` (the router dtype), saving x and W as they are (a bf16 model
    keeps no fp32 copy of its activations for the router's backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.save_for_backward(x, weight, bias)
        ctx.dtype = dtype
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        w = weight.to(dtype)
        logits = flat @ w.t() if bias is None else torch.addmm(bias.to(dtype), flat, w.t())
        return logits.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        flat_grad = grad.reshape(-1, grad.shape[-1])
        flat_x = x.reshape(-1, x.shape[-1]).to(ctx.dtype)
        grad_x = (flat_grad @ weight.to(ctx.dtype)).to(x.dtype).view_as(x)
        grad_w = (flat_grad.t() @ flat_x).to(weight.dtype)
        grad_b = None if bias is None else flat_grad.sum(0).to(bias.dtype)
        return grad_x, grad_w, grad_b, None


def gate_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """[..., h] -> [..., E] router logits in `dtype`."""
    return _GateLinear.apply(x, weight, bias, dtype)


class _RandomLogits(torch.autograd.Function):
    """--moe-router-force-load-balancing (benchmarks): standard-normal logits in place of the gate's,
    the gradient passed straight through to the gate (megatron-core's RandomSTE)."""

    @staticmethod
    def forward(ctx, logits, generator):
        return torch.empty_like(logits).normal_(generator=generator)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def random_logits(logits: torch.Tensor, rank_offset: int = 0) -> torch.Tensor:
    """Random logits of `logits`' shape and dtype. megatron-core draws them from its expert-parallel
    stream, seeded seed + 1024 + 100 * EP rank + ETP rank: independent across the ranks that
    exchange tokens. Here a generator on logits' device is seeded with one draw of the CPU default
    stream (host-side; a recompute's RNG snapshot replays it) plus `rank_offset` (the router's
    100 * EP rank + ETP rank)."""
    seed = int(torch.randint(0, 2**62, (1,)).item()) + rank_offset
    return _RandomLogits.apply(logits, torch.Generator(device=logits.device).manual_seed(seed))


def _float32_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Top-k among the experts of each token's best `group_topk` groups (DeepSeek's device/node-limited
    routing); a group is scored by the sum of its top topk/group_topk expert scores."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1)[0].sum(dim=-1)  # [N, groups]
    chosen = group_scores.topk(group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax",
                 pre_softmax: bool = False, num_groups: int | None = None,
                 group_topk: int | None = None, scaling_factor: float | None = None,
                 expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (probs [N, E], routing_map [N, E]).

    softmax: over the k chosen logits, or with pre_softmax over all E before choosing.
    sigmoid: the chosen sigmoid scores normalized to sum 1 (k > 1); an expert bias (aux-loss-free
    balancing) shifts only which experts are chosen, not their weights.
    """

    def choose(scores):
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return scores.topk(topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            chosen, indices = choose(_float32_softmax(logits))
        else:
            top_logits, indices = choose(logits)
            chosen = _float32_softmax(top_logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            indices = choose(scores + expert_bias)[1]
            chosen = scores.gather(1, indices).type_as(logits)
        else:
            chosen, indices = choose(scores)
        if topk > 1:
            chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise AssertionError(f"unknown score function {score_function}")
    if scaling_factor:
        chosen = chosen * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, indices, chosen)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return probs, routing_map


def aux_loss_scores(logits: torch.Tensor, topk: int, score_function: str):
    """(routing_map, scores) the balancing losses see: every expert's score (softmax in float32, or
    sigmoid normalized per token) and a plain top-k map of them (no groups, no bias, no dropping)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = scores.topk(topk, dim=1)[1]
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True), scores


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert takes at most: ceil(num_tokens / num_experts * capacity_factor), where
    num_tokens counts token-expert pairs (tokens * topk)."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def drop_to_capacity(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float,
                     drop_policy: str = "probs", pad_to_capacity: bool = False):
    """Keep at most `capacity` tokens per expert: those of highest probability (probs) or the first
    ones (position). With pad_to_capacity every expert takes exactly `capacity` tokens, the extra
    ones with probability 0 (capacity above the token count: every token)."""
    tokens, experts = probs.shape
    capacity = expert_capacity(tokens * topk, experts, capacity_factor)
    if capacity > tokens:
        keep = torch.ones_like(routing_map)
    else:
        ranked = probs if drop_policy == "probs" else routing_map.int()
        chosen = ranked.topk(capacity, dim=0, sorted=False)[1]  # [capacity, E]
        keep = torch.zeros_like(routing_map).scatter(0, chosen, True)
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map
