"""Vocab-parallel cross entropy equals F.cross_entropy on the gathered logits (float64, gloo).

The real vocabulary (13) is not divisible by TP, so it is padded to a multiple of TP as the model
does. Two treatments of the padded columns are checked: as ordinary never-targeted classes
(Megatron's model) and filled with -inf (then the loss is exactly the unpadded 13-class loss).
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from megafab.distributed import cross_entropy
from megafab.distributed.cross_entropy import vocab_parallel_cross_entropy
from megafab.distributed.topology import build_topology
from megafab.run.fork_ranks import run_ranks

F64 = torch.float64
S, B, REAL_VOCAB = 8, 3, 13


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-10)


def rand(seed, *shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _reference(full_logits, target, weights, label_smoothing=0.0, classes=None):
    logits = full_logits[..., :classes].clone().requires_grad_(True)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none",
                           label_smoothing=label_smoothing).view(target.shape)
    (loss * weights).sum().backward()
    return loss.detach(), logits.grad


def _parallel_one(full_logits, target, weights, group, r, tp, label_smoothing=0.0, fused=False):
    local = full_logits.chunk(tp, dim=-1)[r].clone().requires_grad_(True)  # [s, b, V/tp]
    before = local.detach().clone()
    loss = vocab_parallel_cross_entropy(local, target, group, label_smoothing=label_smoothing, fused=fused)
    assert loss.shape == target.shape
    (loss * weights).sum().backward()
    assert torch.equal(local.detach(), before), "the caller's logits were modified"
    return loss.detach(), local.grad


def _check_cross_entropy(rank, world, tp, fused=False):
    _parallel = functools.partial(_parallel_one, fused=fused)
    topo = build_topology(tp=tp)
    group, r = topo.group("tp"), topo.tp_rank
    padded = -(-REAL_VOCAB // tp) * tp
    target = torch.randint(0, REAL_VOCAB, (S, B), generator=torch.Generator().manual_seed(1))
    weights = rand(2, S, B)  # a non-uniform upstream gradient, like a loss mask / token count
    logits = 3 * rand(3, S, B, padded)

    # padded columns as ordinary classes; and with a huge offset (a naive exp would overflow)
    for full in (logits, logits + 1000.0):
        loss, grad = _parallel(full, target, weights, group, r, tp)
        ref_loss, ref_grad = _reference(full, target, weights)
        close(loss, ref_loss)
        close(grad, ref_grad.chunk(tp, dim=-1)[r])
    assert torch.isfinite(loss).all()

    # padded columns masked with -inf: exactly the unpadded REAL_VOCAB-class cross entropy
    masked = logits.clone()
    masked[..., REAL_VOCAB:] = float("-inf")
    loss, grad = _parallel(masked, target, weights, group, r, tp)
    ref_loss, ref_grad = _reference(logits, target, weights, classes=REAL_VOCAB)
    close(loss, ref_loss)
    full_ref_grad = torch.cat([ref_grad, torch.zeros(S, B, padded - REAL_VOCAB, dtype=F64)], dim=-1)
    close(grad, full_ref_grad.chunk(tp, dim=-1)[r])

    # label smoothing, torch's definition over all (padded) classes
    loss, grad = _parallel(logits, target, weights, group, r, tp, label_smoothing=0.1)
    ref_loss, ref_grad = _reference(logits, target, weights, label_smoothing=0.1)
    close(loss, ref_loss)
    close(grad, ref_grad.chunk(tp, dim=-1)[r])

    calls = []  # collectives of one call, plain and label-smoothed
    real = cross_entropy.dist.all_reduce
    cross_entropy.dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for smoothing in (0.0, 0.1):
            _parallel(logits, target, weights, group, r, tp, label_smoothing=smoothing)
    finally:
        cross_entropy.dist.all_reduce = real
    return len(calls)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_vocab_parallel_cross_entropy_equals_torch(tp, fused):
    # --cross-entropy-loss-fusion: max, then one all-reduce for everything else (3 + 4 -> 2 + 2)
    assert run_ranks(_check_cross_entropy, 4, tp, fused, timeout=90) == [4 if fused else 7] * 4


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_one_process_equals_torch(label_smoothing):
    logits, target, weights = rand(4, S, B, 16), torch.randint(0, 16, (S, B)), rand(5, S, B)
    loss, grad = _parallel_one(logits, target, weights, None, 0, 1, label_smoothing)
    ref_loss, ref_grad = _reference(logits, target, weights, label_smoothing)
    close(loss, ref_loss)
    close(grad, ref_grad)


def test_low_precision_logits_are_computed_in_float32():
    logits = rand(6, S, B, 16).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, 16, (S, B))
    loss = vocab_parallel_cross_entropy(logits, target, None)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(logits.detach().float().reshape(-1, 16), target.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), ref, rtol=1e-6, atol=1e-6)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_mismatched_shapes_and_bad_smoothing_are_user_errors():
    with pytest.raises(ValueError, match="does not match target shape"):
        vocab_parallel_cross_entropy(torch.zeros(4, 2, 8), torch.zeros(4, 3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="label_smoothing is 1.5"):
        vocab_parallel_cross_entropy(torch.zeros(4, 2, 8), torch.zeros(4, 2, dtype=torch.long), None, 1.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on GPU machines)")
def test_cuda_one_process_equals_torch():
    cuda = torch.device("cuda")
    logits, target, weights = rand(7, S, B, 16), torch.randint(0, 16, (S, B)), rand(8, S, B)
    local = logits.to(cuda).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target.to(cuda), None, label_smoothing=0.1)
    (loss * weights.to(cuda)).sum().backward()
    ref_loss, ref_grad = _reference(logits, target, weights, label_smoothing=0.1)
    close(loss.detach().cpu(), ref_loss)
    close(local.grad.cpu(), ref_grad)
