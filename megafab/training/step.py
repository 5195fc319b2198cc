"""One training iteration and one evaluation pass through the pipeline schedule."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from megafab.data.packed_documents import attach_document_mask
from megafab.distributed.context_parallel import context_parallel_masked_mean, split_for_context_parallel
from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.fsdp import compute_dtype
from megafab.distributed.pipeline import get_forward_backward_func
from megafab.distributed.pipeline_steps import timed
from megafab.model.gpt import masked_mean_loss
from megafab.plan.flops import flops_per_iteration
from megafab.training import nan_check
from megafab.training.batch_size import global_batch_size_at, num_micro_batches_at
from megafab.training.loop_hooks import empty_unused_memory
from megafab.training.moe import (
    after_backward,
    balancing_loss_scale,
    logged_balancing_losses,
    moe_settings,
    set_balancing_loss_scale,
)
from megafab.training.mtp import logged_mtp_losses, mtp_loss_scale, set_mtp_loss_scale


def _to_device(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def _upcast(per_token_loss: torch.Tensor) -> torch.Tensor:
    return per_token_loss.float() if per_token_loss.dtype != torch.float64 else per_token_loss


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor, cp_group=None):
    """The micro-batch's masked mean; under CP over the whole sequence (all CP ranks' tokens)."""
    if cp_group is None:
        loss = masked_mean_loss(_upcast(per_token_loss), loss_mask)
    else:
        loss = context_parallel_masked_mean(_upcast(per_token_loss), loss_mask, cp_group)
    return loss, {"lm loss": loss.detach()}


def per_token_loss_func(scale: float, loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """--calculate-per-token-loss: sum(loss * mask) * scale, where scale = micro-batches x dp x cp /
    (tokens of the global batch), so that after the schedule's mean over micro-batches and DDP's
    mean over DP x CP the gradient is that of sum(loss * mask over the global batch) / its tokens
    (under CP each rank sums its own tokens)."""
    mask = loss_mask.to(torch.float64 if per_token_loss.dtype == torch.float64 else torch.float32)
    total = (_upcast(per_token_loss) * mask).sum()
    return total * scale, {"lm loss sum": total.detach(), "tokens": mask.sum().detach()}


def get_batch_on_this_cp_rank(batch: dict, cp_group) -> dict:
    """Megatron's name: this CP rank's two chunks of every [b, s] field (positions made explicit,
    so learned and rotary embeddings see the tokens' global positions); an attention_mask stays the
    whole sequence's (CP attention takes the rows of its queries)."""
    if cp_group is None:
        return batch
    cp, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    batch = dict(batch)
    if batch.get("position_ids") is None:
        b, s = batch["tokens"].shape
        batch["position_ids"] = torch.arange(s, device=batch["tokens"].device).expand(b, s)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        batch[key] = split_for_context_parallel(batch[key], 1, cp_rank, cp)
    return batch


def gpt_forward_step(data_iterator, model, token_scale: float | None = None, cp_group=None, timers=None):
    """Megatron's contract: (output, loss_func). Every stage reads the batch (RoPE needs positions);
    with context parallelism every CP rank reads the same samples and keeps its chunks."""
    with timed(timers, "batch-generator", 2):
        batch = _to_device(next(data_iterator), next(model.parameters()).device)
        batch = get_batch_on_this_cp_rank(attach_document_mask(batch), cp_group)
    output = model(batch["tokens"], batch.get("position_ids"), labels=batch["labels"],
                   attention_mask=batch.get("attention_mask"), loss_mask=batch["loss_mask"])
    if token_scale is not None:
        return output, functools.partial(per_token_loss_func, token_scale, batch["loss_mask"])
    return output, functools.partial(loss_func, batch["loss_mask"], cp_group=cp_group)


def global_batch_tokens(batches: list, topo) -> float:
    """Loss tokens (sum of loss masks) of this step's whole global batch, over all DP ranks."""
    local = torch.tensor([float(sum(b["loss_mask"].sum() for b in batches))], dtype=torch.float64,
                         device=topo.device)
    if topo.dp > 1:
        dist.all_reduce(local, group=topo.group("dp"))
    return local.item()


def run_schedule(state, data_iterator, forward_only: bool, num_micro_batches: int | None = None,
                 timers=None, micro_batch_size: int | None = None) -> list:
    """One forward(-backward) pass over a global batch of num_micro_batches (default: the config's;
    fewer while a batch-size ramp ramps up) of micro_batch_size samples (default: the config's; the
    evaluation's own). timers: megafab.timers.Timers (or None)."""
    cfg, topo = state.cfg, state.topology
    p, t, m = cfg.parallel, cfg.training, cfg.model
    num_micro_batches = num_micro_batches or t.num_micro_batches
    vpp = p.virtual_pipeline_model_parallel_size or 1
    schedule = get_forward_backward_func(topo.pp, vpp)
    # Every chunk of this rank reads the same micro-batches (Megatron gives each chunk its own
    # iterator over the same data): take this step's batches once and replay them per chunk.
    batches = [next(data_iterator) for _ in range(num_micro_batches)]
    iterators = [iter(batches) for _ in range(vpp)] if vpp > 1 else iter(batches)
    cp_group = topo.group("cp") if topo.cp > 1 else None
    moe = moe_settings(cfg)
    scaler = getattr(state.optimizer, "grad_scaler", None)
    token_scale = tokens = None
    if t.calculate_per_token_loss:
        # Only the last stage's training loss is scaled (the logs carry the unscaled sums), and a DP
        # group lies within one stage, so the other stages skip the all-reduce (unless their MoE
        # layers' balancing losses need the count too).
        token_scale = 1.0
        if (topo.is_last_stage or moe is not None) and not forward_only:
            tokens = global_batch_tokens(batches, topo)  # full samples: every CP rank counts alike
        if topo.is_last_stage and not forward_only:
            token_scale = num_micro_batches * topo.dp * topo.cp / max(tokens, 1.0)
    if moe is not None and not forward_only:  # read by the balancing losses' backward
        set_balancing_loss_scale(state.model, balancing_loss_scale(
            scaler.scale if scaler is not None else 1.0, topo, num_micro_batches, tokens))
    if m.mtp_num_layers and not forward_only:  # read by the MTP losses' backward (last stage)
        set_mtp_loss_scale(state.model, mtp_loss_scale(
            scaler.scale if scaler is not None else 1.0, topo, num_micro_batches, tokens))
    forward_step = functools.partial(gpt_forward_step, cp_group=cp_group, timers=timers,
                                     token_scale=token_scale)

    def finalize(models):
        with timed(timers, "all-grads-sync", 1):
            finalize_model_grads(models, topology=topo, sequence_parallel=p.sequence_parallel)
            if moe is not None:
                after_backward(models, moe, topo)
    return schedule(
        forward_step_func=forward_step, data_iterator=iterators,
        model=state.model if vpp > 1 else state.model[0], num_microbatches=num_micro_batches,
        seq_length=m.seq_length // topo.cp, micro_batch_size=micro_batch_size or t.micro_batch_size,
        hidden_size=m.hidden_size,
        topology=topo, dtype=compute_dtype(state.model[0]), forward_only=forward_only,
        sequence_parallel=p.sequence_parallel,
        finalize_model_grads_func=None if forward_only else finalize,
        no_sync_func=None if forward_only else [c.no_sync for c in state.model],
        loss_scale=scaler.scale if scaler is not None else 1.0, timers=timers,
        microbatch_group_size_per_vp_stage=p.microbatch_group_size_per_vp_stage)


def average_loss_across_dp(logs: list, topo, device) -> float | None:
    """Mean over micro-batches on this rank, then over DP ranks (last stage only; every CP rank
    already holds its samples' whole-sequence loss); with the per-token loss, sum of token losses /
    tokens over the whole global batch (all DP x CP ranks' tokens)."""
    if not topo.is_last_stage:
        return None
    if logs and "tokens" in logs[0]:
        sums = torch.stack([torch.stack([log["lm loss sum"], log["tokens"]]).double() for log in logs])
        total = sums.sum(dim=0).to(device)
        dist.all_reduce(total, group=topo.group("dp", "cp"))  # under CP each rank summed its own tokens
        return (total[0] / total[1]).item()
    local = torch.stack([log["lm loss"].double() for log in logs]).mean() if logs else \
        torch.tensor(float("nan"), dtype=torch.float64)
    local = local.to(device)
    dist.all_reduce(local, group=topo.group("dp"))
    return local.item() / topo.dp


def nan_iteration(grad_norm: float | None) -> bool:
    """An iteration Megatron counts among its "nan iterations": its gradient norm is not finite."""
    return grad_norm is not None and not math.isfinite(grad_norm)


def train_step(state, data_iterator, timers=None) -> dict:
    check = state.cfg.training.check_for_nan_in_loss_and_grad
    state.optimizer.zero_grad()  # zeroes every chunk's DDP grad buffer (once: it is a full memset)
    gbs = global_batch_size_at(state.cfg, state.consumed_train_samples)  # a ramp or step schedule's
    num_micro_batches = num_micro_batches_at(state.cfg, state.consumed_train_samples)
    with timed(timers, "forward-backward", 1):
        logs = run_schedule(state, data_iterator, forward_only=False, timers=timers,
                            num_micro_batches=num_micro_batches)
    moe = moe_settings(state.cfg)
    moe_losses = {} if moe is None else logged_balancing_losses(state.model, moe, state.cfg, state.topology,
                                                                num_micro_batches)
    mtp_losses = logged_mtp_losses(state.model, state.topology, num_micro_batches) \
        if state.cfg.model.mtp_num_layers else {}
    if check:
        nan_check.check_losses(state, logs)
    memory_level = state.cfg.training.empty_unused_memory_level
    empty_unused_memory(memory_level, 1, state.topology.device)
    with timed(timers, "optimizer", 1):
        ok, grad_norm, num_zeros = state.optimizer.step()
    if check:
        nan_check.check_grad_norm(state, grad_norm)
    empty_unused_memory(memory_level, 2, state.topology.device)
    state.consumed_train_samples += gbs
    state.iteration += 1
    state.num_floating_point_operations_so_far += flops_per_iteration(state.cfg, gbs)  # this batch's
    if ok:
        state.scheduler.step(gbs)
        state.consecutive_skipped = 0
    else:
        state.skipped_iterations += 1
        state.consecutive_skipped += 1
    loss = average_loss_across_dp(logs, state.topology, state.topology.device)
    if nan_iteration(grad_norm):
        state.nan_iterations += 1
    nan_check.check_skips(state)
    return {"lm loss": loss, "grad_norm": grad_norm, "num_zeros": num_zeros, "update_ok": ok,
            "global_batch_size": gbs, "moe_losses": moe_losses, "mtp_losses": mtp_losses}


def evaluate(state, data_iterator, eval_iters: int, counts_as_validation: bool = True) -> float | None:
    """Mean loss over eval_iters batches of --eval-global-batch-size samples in micro-batches of
    --eval-micro-batch-size (Megatron HEAD's evaluate; both default to training's); validation batches
    are counted in state.consumed_valid_samples, so a resumed run evaluates on the batches the first
    run would."""
    t = state.cfg.training
    micro_batches = t.eval_global_batch_size // (t.eval_micro_batch_size * state.topology.dp)
    for chunk in state.model:
        chunk.eval()
    losses = []
    with torch.no_grad():
        for _ in range(eval_iters):
            logs = run_schedule(state, data_iterator, forward_only=True, num_micro_batches=micro_batches,
                                micro_batch_size=t.eval_micro_batch_size)
            empty_unused_memory(state.cfg.training.empty_unused_memory_level, 1, state.topology.device)
            losses.append(average_loss_across_dp(logs, state.topology, state.topology.device))
            if counts_as_validation:
                state.consumed_valid_samples += t.eval_global_batch_size
    for chunk in state.model:
        chunk.train()
    return sum(losses) / len(losses) if state.topology.is_last_stage and losses else None
