"""--moe-router-load-balancing-type sinkhorn (S-BASE): megatron-core 0.16.1's sinkhorn_load_balancing.

Training: a no-grad Sinkhorn normalisation of the float32 logits (whatever the router dtype) picks
each token's top-k experts; eval: the plain top-k of the scores. The scores, which carry the gradient,
are sigmoid(logits) at top-1 and the float32 softmax over all experts above, in the logits' dtype;
a token's probs are its scores at the picked experts (0 elsewhere). No auxiliary loss.

Layout: the normalisation runs over the tokens this router sees, so the choice of one token depends
on the other tokens of the same rank. Under sequence parallelism (TP > 1 with MoE) or context
parallelism each rank normalises its own slice of the sequence, exactly as megatron-core does (no
collective is added); the routing then differs from one process's. Layouts that leave every router
its tokens (DP, EP, PP, the distributed optimizer) give the one-process result.
"""

from __future__ import annotations

import torch

TOLERANCE = 1e-4  # megatron-core's: the mean change of the expert scaling that ends the iteration
EPS = 1e-8


@torch.no_grad()
def sinkhorn(cost: torch.Tensor, tol: float = TOLERANCE) -> torch.Tensor:
    """cost [N, E] -> exp(cost) scaled by a per-token d0 [N] and a per-expert d1 [E] so that its rows
    sum to ~1/N and its columns to ~1/E, iterated until d1 moves by <= tol on average (megatron-core's
    loop and operation order, so the float32 results are bit-equal)."""
    cost = torch.exp(cost)
    tokens, experts = cost.shape
    d1 = torch.ones(experts, device=cost.device, dtype=cost.dtype)
    d0, d1_old, error = None, d1, 1e9
    while error > tol:
        d0 = (1 / tokens) / (torch.sum(d1 * cost, 1) + EPS)
        d1 = (1 / experts) / (torch.sum(d0.unsqueeze(1) * cost, 0) + EPS)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_scores(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Every expert's score [N, E]: sigmoid at top-1, the float32 softmax otherwise, in logits' dtype."""
    if topk == 1:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (probs [N, E], routing_map [N, E]) as megatron-core routes with sinkhorn;
    `training` is the module's mode (megatron-core reads self.training, not the grad mode)."""
    scores = sinkhorn_scores(logits, topk)
    chosen_from = sinkhorn(logits.float()) if training else scores
    indices = torch.topk(chosen_from, k=topk, dim=1)[1]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return scores * routing_map, routing_map
