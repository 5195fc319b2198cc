"""masked_attention's math against plain PyTorch (float64): window masks by position (Megatron/TE's
(left, 0): left + 1 keys, HF's sliding_window W = left + 1), the sink as an extra logit, and
sink_attention (the fused kernel, or the tiled reference kernel with a window) equal to the explicit
softmax in output and every gradient (q, k, v, sink) while keeping no [s, s] tensor for backward."""

import pytest
import torch

from megafab.distributed import blockwise_attention as ba
from megafab.distributed.masked_attention import (
    attention,
    bottom_right_positions,
    sink_attention,
    window_mask,
)


def _explicit(q, k, v, left, sink):
    """softmax over [scores, sink] with query i seeing keys i-left..i, heads repeated per group."""
    hpg = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(hpg, 1), v.repeat_interleave(hpg, 1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    scores = scores.masked_fill((j > i) | (j < i - left), float("-inf"))
    logits = torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    return torch.softmax(logits, -1)[..., :-1] @ v


def test_window_mask_sees_left_plus_one_keys():
    masked = window_mask(*bottom_right_positions(6, 6), 2)
    assert (~masked).sum(-1).tolist() == [1, 2, 3, 3, 3, 3]
    assert not masked[5, 3] and masked[5, 2] and masked[2, 3]
    # a KV-cache step: the 2 new queries are positions 4 and 5 of 6 keys
    assert torch.equal(window_mask(*bottom_right_positions(2, 6), 2), masked[4:])


@pytest.mark.parametrize("left", [None, 0, 3])
def test_sink_attention_equals_the_explicit_softmax(monkeypatch, left):
    monkeypatch.setattr(ba, "TILE_ELEMENTS", 2 * 4 * 13 * 3)  # several query tiles
    torch.manual_seed(0)
    q = torch.randn(2, 4, 13, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 13, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 4, 13, 8, dtype=torch.float64)
    ref = _explicit(q, k, v, 13 if left is None else left, sink)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sink), dout)
    for out in (attention(q, k, v, window_mask(*bottom_right_positions(13, 13), left), sink),
                sink_attention(q, k, v, sink, left)):
        assert (out - ref).abs().max().item() < 1e-13
        for mine, theirs in zip(torch.autograd.grad(out, (q, k, v, sink), dout), ref_grads):
            assert (mine - theirs).abs().max().item() < 1e-13
    plain = _explicit(q, k, v, 13, torch.full((4,), -1e4, dtype=torch.float64))
    assert (plain - ref).abs().max().item() > 1e-2  # the window and the sink are in effect


def _largest_saved(fn, *args) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*args).sum().backward()
    return max(t.numel() for t in saved)


def test_sink_attention_keeps_no_score_matrix():
    s, d = 64, 8
    q = torch.randn(1, 4, s, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 4, s, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sink = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    for window in (None, 5):
        assert _largest_saved(sink_attention, q, k, v, sink, window) <= s * 4 * d  # q, k, v, out
        masked = window_mask(*bottom_right_positions(s, s), window)
        assert _largest_saved(attention, q, k, v, masked, sink) >= 4 * s * s  # the probabilities
