"""Megatron's --check-for-nan-in-loss-and-grad, and megafab's limit on skipped iterations in a row.

A nan or inf loss (any precision) or gradient norm (bf16/fp32: no loss scaler can skip it) stops
the run before the optimizer touches the parameters, naming the iteration, the ranks that saw it
and the last good checkpoint. Every rank takes the same decision: the loss flag is reduced over the
world (one 1-element all-reduce per iteration), the gradient norm is global already. With the check
off such iterations are skipped, as fp16 loss-scale overflows always are; a run that skips
--max-consecutive-skipped-iterations in a row stops too, since it no longer trains.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megafab.checkpoint.directory import iteration_dir, latest_iteration
from megafab.errors import MegafabError


class NonFiniteTrainingError(MegafabError):
    """Training diverged: a non-finite loss or gradient norm, or too many skipped steps in a row."""


def ranks_with(flag: bool, device) -> list[int]:
    """Collective over the world: the ranks whose `flag` is true."""
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[dist.get_rank()] = 1.0 if flag else 0.0
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f > 0]


def last_good_checkpoint(cfg) -> str:
    for root in (cfg.checkpoint.save, cfg.checkpoint.load):
        if root:
            try:
                iteration = latest_iteration(root)
            except MegafabError:
                iteration = None
            if iteration is not None:
                return (f"the last good checkpoint is {iteration_dir(root, iteration)} "
                        f"(resume with --load {root})")
    return "no checkpoint was saved before it"


def _stop(state, what: str, ranks: list[int]) -> NonFiniteTrainingError:
    return NonFiniteTrainingError(
        f"iteration {state.iteration + 1}: {what} on rank(s) {ranks}; training stopped before the "
        f"optimizer step (--check-for-nan-in-loss-and-grad, on by default as in Megatron); "
        f"{last_good_checkpoint(state.cfg)}. Lower --lr or lengthen the warmup, look at the data "
        f"after consumed sample {state.consumed_train_samples}, or pass "
        f"--no-check-for-nan-in-loss-and-grad to skip such iterations instead")


def check_losses(state, logs: list) -> None:
    """Collective: raise if any micro-batch loss of this iteration is nan or inf on any rank."""
    device = state.topology.device
    if logs:  # a micro-batch's mean loss, or its token-loss sum with --calculate-per-token-loss
        losses = torch.stack([log.get("lm loss", log.get("lm loss sum")).reshape(()).float()
                              for log in logs]).to(device)
        bad = (~torch.isfinite(losses)).any().float().reshape(1)
    else:  # not the last pipeline stage: no loss here
        bad = torch.zeros(1, device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item() > 0:
        local = bool(logs) and not bool(torch.isfinite(losses).all())
        raise _stop(state, "the loss is nan or inf", ranks_with(local, device))


def local_grads_finite(optimizer) -> bool:
    return all(bool(torch.isfinite(e.model_grad()).all()) for e in optimizer.entries
               if e.model_grad() is not None)


def check_grad_norm(state, grad_norm: float | None) -> None:
    """Collective when the (global, so equal on every rank) gradient norm is not finite."""
    if grad_norm is None or math.isfinite(grad_norm):
        return
    ranks = ranks_with(not local_grads_finite(state.optimizer), state.topology.device)
    raise _stop(state, f"the gradient norm is {grad_norm} (non-finite gradients)", ranks)


def check_skips(state) -> None:
    limit = state.cfg.training.max_consecutive_skipped_iterations
    if not limit or state.consecutive_skipped < limit:
        return
    scaler = getattr(state.optimizer, "grad_scaler", None)
    scale = f" (the fp16 loss scale is down to {scaler.scale:g})" if scaler is not None else ""
    first = state.iteration - state.consecutive_skipped + 1
    raise NonFiniteTrainingError(
        f"iterations {first}..{state.iteration}: {state.consecutive_skipped} optimizer steps in a row "
        f"were skipped for non-finite gradients{scale}, so the model no longer trains "
        f"(--max-consecutive-skipped-iterations {limit}); {last_good_checkpoint(state.cfg)}. Lower "
        f"--lr, check the data, or raise the limit (0: never stop)")
