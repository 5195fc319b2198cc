"""Next-token choice from logits: greedy, or temperature with top-k and top-p (nucleus) filtering."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [b, V] with everything outside the top k / the smallest set of probability >= top_p
    set to -inf (the most likely token always stays)."""
    logits = logits.clone()
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
        drop_sorted = before >= top_p
        logits[drop_sorted.scatter(-1, order, drop_sorted)] = float("-inf")
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [b, V] -> token ids [b]. temperature 0 (or top_k 1) is greedy."""
    if temperature <= 0.0 or top_k == 1:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
