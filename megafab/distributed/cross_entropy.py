"""Cross entropy over logits split along the vocabulary across a tensor-parallel group.

Equal in value and gradient to F.cross_entropy(gathered_logits, target, reduction='none') without
ever gathering the logits: three small all-reduces over [s, b] (max, target logit, sum of exps,
plus the logit sum with label smoothing) replace an all-gather of [s, b, V]; two when fused.

Padded vocabulary entries (Megatron pads V to a multiple of make-vocab-size-divisible-by x TP) are
ordinary classes here, as in Megatron: they are never targets and their probability is trained
down. A caller that wants them out of the softmax fills those logits with -inf first (label
smoothing must then be 0, since it averages over every class).

Computation runs in at least float32 (bf16/fp16 logits are upcast); the loss has that dtype and
the gradient the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megafab.distributed.mappings import group_rank, group_size


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _single_rank_forward(flat: torch.Tensor, target: torch.Tensor, label_smoothing: float):
    """One rank holds the whole vocabulary: one fused log_softmax pass over [n, V] instead of the
    max / subtract / exp / sum / divide passes (each a fresh [n, V] on the CPU) the collectives need."""
    log_probs = torch.log_softmax(flat, dim=-1)  # [n, V]
    loss = -log_probs.gather(1, target.unsqueeze(1)).squeeze(1)
    if label_smoothing > 0.0:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * log_probs.mean(dim=-1)
    return loss, log_probs.exp_()  # the softmax, in place


def _sum_together(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """One all-reduce for several [n] tensors (megatron-core's fused cross entropy)."""
    stacked = _all_reduce(torch.stack(tensors), group)
    return list(stacked.unbind(0))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing, fused=False):
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        part = logits.shape[-1]
        vocab = part * group_size(group)
        start = group_rank(group) * part
        flat = logits.reshape(-1, part).to(compute_dtype)  # [n, V/tp], a new tensor when upcast
        flat_target = target.reshape(-1)
        if group_size(group) == 1:
            loss, softmax = _single_rank_forward(flat, flat_target, label_smoothing)
            local_target, outside = flat_target, torch.zeros_like(flat_target, dtype=torch.bool)
            ctx.save_for_backward(softmax, local_target, outside)
            ctx.label_smoothing, ctx.vocab, ctx.logits_dtype = label_smoothing, vocab, logits.dtype
            ctx.logits_shape = logits.shape
            return loss.view(target.shape)

        row_max = _all_reduce(flat.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = flat - row_max.unsqueeze(-1)  # out of place: the caller's logits stay intact

        outside = (flat_target < start) | (flat_target >= start + part)
        local_target = (flat_target - start).masked_fill(outside, 0)
        rows = torch.arange(flat.shape[0], device=flat.device)
        target_logit = shifted[rows, local_target].masked_fill(outside, 0.0)
        sum_shifted = shifted.sum(dim=-1) if label_smoothing > 0.0 else None
        if not fused:
            target_logit = _all_reduce(target_logit, group)
            sum_shifted = _all_reduce(sum_shifted, group) if sum_shifted is not None else None
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if fused:
            parts = [target_logit, sum_exp] + ([sum_shifted] if sum_shifted is not None else [])
            target_logit, sum_exp, *rest = _sum_together(parts, group)
            sum_shifted = rest[0] if rest else None
        else:
            sum_exp = _all_reduce(sum_exp, group)
        log_z = sum_exp.log()
        loss = log_z - target_logit  # -log p(target)
        if label_smoothing > 0.0:
            # torch's definition: (1 - eps) * nll + eps * mean over all V classes of -log p
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - sum_shifted / vocab)

        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [n, V/tp]
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab, ctx.logits_dtype = label_smoothing, vocab, logits.dtype
        ctx.logits_shape = logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()  # d loss / d logits = softmax - (1 - eps) * onehot - eps / V
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (1.0 - eps) * (~outside).to(grad.dtype)
        if eps > 0.0:
            grad -= eps / ctx.vocab
        grad *= grad_loss.reshape(-1, 1).to(grad.dtype)
        return grad.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group,
                                 label_smoothing: float = 0.0, fused: bool = False) -> torch.Tensor:
    """Per-token loss [s, b] from this rank's logits [s, b, V/tp] and global target ids [s, b].

    Rank r holds vocabulary columns [r*V/tp, (r+1)*V/tp) (layers.vocab_range). tp_group None means
    one process. label_smoothing follows F.cross_entropy's definition over all V (padded) classes.
    fused (--cross-entropy-loss-fusion): the target logit and the sum of exponentials (and the logit
    sum with label smoothing) share one all-reduce after the max's, as megatron-core's fused
    cross entropy does; same values.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing is {label_smoothing}; it must be in [0, 1)")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits shape {tuple(vocab_parallel_logits.shape)} does not match target shape "
                         f"{tuple(target.shape)}; logits must be target's shape + [V/tp]")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, float(label_smoothing),
                                            fused)
