"""One training iteration and one evaluation pass through the pipeline schedule."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.fsdp import compute_dtype
from megafab.distributed.pipeline import get_forward_backward_func
from megafab.model.gpt import masked_mean_loss


def _to_device(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    loss = masked_mean_loss(per_token_loss.float() if per_token_loss.dtype != torch.float64
                            else per_token_loss, loss_mask)
    return loss, {"lm loss": loss.detach()}


def gpt_forward_step(data_iterator, model):
    """Megatron's contract: (output, loss_func). Every stage reads the batch (RoPE needs positions)."""
    batch = _to_device(next(data_iterator), next(model.parameters()).device)
    output = model(batch["tokens"], batch.get("position_ids"), labels=batch["labels"],
                   attention_mask=batch.get("attention_mask"))
    return output, functools.partial(loss_func, batch["loss_mask"])


def run_schedule(state, data_iterator, forward_only: bool) -> list:
    cfg, topo = state.cfg, state.topology
    p, t, m = cfg.parallel, cfg.training, cfg.model
    vpp = p.virtual_pipeline_model_parallel_size or 1
    schedule = get_forward_backward_func(topo.pp, vpp)
    # Every chunk of this rank reads the same micro-batches (Megatron gives each chunk its own
    # iterator over the same data): take this step's batches once and replay them per chunk.
    batches = [next(data_iterator) for _ in range(t.num_micro_batches)]
    iterators = [iter(batches) for _ in range(vpp)] if vpp > 1 else iter(batches)
    finalize = functools.partial(finalize_model_grads, topology=topo, sequence_parallel=p.sequence_parallel)
    scaler = getattr(state.optimizer, "grad_scaler", None)
    return schedule(
        forward_step_func=gpt_forward_step, data_iterator=iterators,
        model=state.model if vpp > 1 else state.model[0], num_microbatches=t.num_micro_batches,
        seq_length=m.seq_length, micro_batch_size=t.micro_batch_size, hidden_size=m.hidden_size,
        topology=topo, dtype=compute_dtype(state.model[0]), forward_only=forward_only,
        sequence_parallel=p.sequence_parallel,
        finalize_model_grads_func=None if forward_only else finalize,
        no_sync_func=None if forward_only else [c.no_sync for c in state.model],
        loss_scale=scaler.scale if scaler is not None else 1.0)


def average_loss_across_dp(logs: list, topo, device) -> float | None:
    """Mean over micro-batches on this rank, then over DP ranks (last stage only)."""
    if not topo.is_last_stage:
        return None
    local = torch.stack([log["lm loss"].double() for log in logs]).mean() if logs else \
        torch.tensor(float("nan"), dtype=torch.float64)
    local = local.to(device)
    dist.all_reduce(local, group=topo.dp_group)
    return local.item() / topo.dp


def train_step(state, data_iterator) -> dict:
    state.optimizer.zero_grad()  # zeroes every chunk's DDP grad buffer (once: it is a full memset)
    logs = run_schedule(state, data_iterator, forward_only=False)
    ok, grad_norm, num_zeros = state.optimizer.step()
    gbs = state.cfg.training.global_batch_size
    state.consumed_train_samples += gbs
    state.iteration += 1
    if ok:
        state.scheduler.step(gbs)
    else:
        state.skipped_iterations += 1
    loss = average_loss_across_dp(logs, state.topology, state.topology.device)
    if grad_norm is not None and not math.isfinite(grad_norm):
        state.nan_iterations += 1
    return {"lm loss": loss, "grad_norm": grad_norm, "num_zeros": num_zeros, "update_ok": ok}


def evaluate(state, data_iterator, eval_iters: int) -> float | None:
    for chunk in state.model:
        chunk.eval()
    losses = []
    with torch.no_grad():
        for _ in range(eval_iters):
            logs = run_schedule(state, data_iterator, forward_only=True)
            losses.append(average_loss_across_dp(logs, state.topology, state.topology.device))
    for chunk in state.model:
        chunk.train()
    return sum(losses) / len(losses) if state.topology.is_last_stage and losses else None
