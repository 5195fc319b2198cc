"""Autoregressive generation with a megafab GPTModel (one process, all layers)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megafab.errors import MegafabError
from megafab.inference.kv_cache import KVCache, causal_mask
from megafab.inference.sampling import sample_next


class GenerationError(MegafabError):
    """A generation request the model cannot serve; the message names the value and the fix."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0
    """0: greedy."""
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eod: int | None = None
    """Stop after generating this token (it is included in the output)."""


def _check_length(model, total: int) -> None:
    m = model.cfg
    if m.position_embedding_type == "learned_absolute" and total > m.max_position_embeddings:
        raise GenerationError(f"prompt + max new tokens = {total} positions, but the model has "
                              f"max_position_embeddings {m.max_position_embeddings}; shorten the prompt or "
                              f"lower --max-new-tokens")


@torch.no_grad()
def generate(model, prompt: list[int], params: SamplingParams, use_kv_cache: bool = True,
             step_seconds: list[float] | None = None) -> list[int]:
    """The new token ids after `prompt` (at most max_new_tokens; stops after eod).
    `step_seconds`, when given, receives each step's wall time (step 0 processes the prompt).

    With the KV cache the prompt is processed once and every new token runs one position through
    the model; without it (for comparison) every step reruns the whole sequence.
    """
    if not prompt:
        raise GenerationError("the prompt is empty; give at least one token")
    if not (model.pre_process and model.post_process):
        raise GenerationError("generation needs the whole model in one chunk (pre_process and post_process)")
    model.eval()
    vocab = model.cfg.vocab_size
    outside = [t for t in prompt if not 0 <= t < vocab]
    if outside:
        raise GenerationError(f"prompt token id(s) {outside[:5]} are outside the model's vocabulary "
                              f"0..{vocab - 1}; give ids below {vocab} (or a text prompt with the tokenizer "
                              f"the model was trained with)")
    device = model.output_weight().device
    total = len(prompt) + params.max_new_tokens
    _check_length(model, total)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, s]
    cache = KVCache(total) if use_kv_cache else None
    step_input, start = tokens, 0
    out = []
    for _ in range(params.max_new_tokens):
        started = time.perf_counter()
        new = step_input.shape[1]
        positions = torch.arange(start, start + new, device=device)[None]  # [1, new]
        mask = causal_mask(new, start + new, device) if use_kv_cache else None
        logits = model(step_input, position_ids=positions, attention_mask=mask, kv_cache=cache)  # [new, 1, V]
        token = sample_next(logits[-1, :, :vocab], params.temperature, params.top_k, params.top_p, generator)
        out.append(int(token))
        if step_seconds is not None:
            step_seconds.append(time.perf_counter() - started)
        if params.eod is not None and out[-1] == params.eod:
            break
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        if use_kv_cache:
            step_input, start = token[:, None], start + new
        else:
            step_input = tokens
    return out
