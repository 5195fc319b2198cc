"""Context parallelism through the driver equals one process: loss, every gradient, the step.

float64, tiny models (2 layers); each layout runs megafab's build_model / build_optimizer and the training
schedule (run_schedule: CP batch split, CP loss, finalize_model_grads over DP x CP), then compares
  - the logged lm loss with the single-process loss,
  - every parameter's main_grad (TP shards gathered; under the distributed optimizer only the
    ranges this rank owns, which tile every parameter over DP x CP) with the reference gradient,
  - the grad norm of the optimizer step and the parameters after it.
"""

import pytest
import torch

from megafab.model.gpt import masked_mean_loss
from megafab.optim.distributed_optimizer import owned_param_ranges
from megafab.optim.mixed_precision import MixedPrecisionOptimizer
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import average_loss_across_dp, run_schedule
from tests.helpers.driver import driver_state
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, batch, full_grad, reference_model, tiny_config

MICRO = 2
TOL = 1e-10
WORD = "embedding.word_embeddings.weight"


def _micro_batches(cfg, dp_rank, dp, count):
    """Megatron's sampler order: micro-batch k of DP rank d holds samples k*b*dp + d*b ... + b."""
    samples = [batch(cfg.model, micro_batch=1, seed=100 + i) for i in range(count * MICRO * dp)]
    for k in range(count):
        chunk = samples[k * MICRO * dp + dp_rank * MICRO:][:MICRO]
        yield {"tokens": torch.cat([c[0] for c in chunk]), "labels": torch.cat([c[1] for c in chunk]),
               "loss_mask": torch.cat([c[2] for c in chunk])}


def _reference(cfg, ref_cfg, micro_batches):
    """One process: mean of micro-batch masked means, or (--calculate-per-token-loss) the masked
    mean over every token of the global batch."""
    model = reference_model(ref_cfg.model)
    total = 0.0
    tokens = sum(mb["loss_mask"].sum() for mb in micro_batches)
    for mb in micro_batches:
        per_token = model(mb["tokens"], labels=mb["labels"])
        if cfg.training.calculate_per_token_loss:
            loss = (per_token * mb["loss_mask"]).sum() / tokens
        else:
            loss = masked_mean_loss(per_token, mb["loss_mask"]) / len(micro_batches)
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    o = cfg.optimizer
    opt = MixedPrecisionOptimizer([model], lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad)
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    _, norm, _ = opt.step()
    return total, grads, norm, {n: p.detach().clone() for n, p in model.named_parameters()}


def _gathered(p, values, tp_group):
    """`values` shaped like this rank's `p`, as the unsharded parameter (TP shards joined)."""
    holder = torch.nn.Parameter(torch.empty_like(p), requires_grad=False)
    holder.grad = values
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(p, attr):
            setattr(holder, attr, getattr(p, attr))
    return full_grad(holder, tp_group)


def _cp_parity(rank, world, tp, cp, pp, sp, dist_opt, comm, style, extra=None):
    dp = world // (tp * cp * pp)
    gbs = MICRO * dp * 2
    common = dict(style=style, vocab_size=112, lr=1e-2, clip_grad=0.5, lr_decay_style="constant",
                  num_layers=2)
    cfg = tiny_config(tp=tp, pp=pp, dp=dp * cp, micro_batch_size=MICRO, global_batch_size=gbs,
                      sequence_parallel=sp, use_distributed_optimizer=dist_opt, context_parallel_size=cp,
                      cp_comm_type=comm, ddp_bucket_size=2000, **common, **(extra or {}))
    assert cfg.parallel.data_parallel_size == dp
    ref_loss, ref_grads, ref_norm, ref_params = _reference(
        cfg, tiny_config(**common), list(_micro_batches(cfg, 0, 1, gbs // MICRO)))

    state = driver_state(cfg, torch.float64)
    topo, model, optimizer = state.topology, state.model, state.optimizer
    assert (topo.cp, topo.dp) == (cp, dp)
    tp_group = topo.group("tp") if tp > 1 else None

    optimizer.zero_grad()
    logs = run_schedule(state, _micro_batches(cfg, topo.dp_rank, dp, cfg.training.num_micro_batches),
                        forward_only=False)
    if topo.is_last_stage:
        loss = average_loss_across_dp(logs, topo, topo.device)
        assert abs(loss - ref_loss) < TOL, (loss, ref_loss)
    checked = 0
    for chunk in model:
        owned = owned_param_ranges(chunk) if dist_opt else None
        for name, p in chunk.module.named_parameters():
            ref = ref_grads[WORD if name == "output_layer.weight" and
                            not cfg.model.untie_embeddings_and_output_weights else name]
            mask = torch.zeros(p.numel(), dtype=torch.float64)
            lo, hi = owned.get(p, (0, 0)) if dist_opt else (0, p.numel())
            mask[lo:hi] = 1.0
            grad = _gathered(p, p.main_grad.detach().clone(), tp_group)
            where = _gathered(p, mask.view(p.shape), tp_group) > 0
            err = (grad - ref).abs()[where].max().item() if where.any() else 0.0
            assert err < TOL, (name, err)
            checked += int(where.sum())
    ok, norm, _ = optimizer.step()
    assert ok and abs(norm - ref_norm) < TOL * max(1.0, ref_norm), (norm, ref_norm)
    for chunk in model:
        for name, p in chunk.module.named_parameters():
            ref = ref_params[WORD if name == "output_layer.weight" and
                             not cfg.model.untie_embeddings_and_output_weights else name]
            assert (_gathered(p, p.detach(), tp_group) - ref).abs().max().item() < TOL, name
    return checked


LAYOUTS = [  # world, tp, cp, pp, sp, dist_opt, comm, style
    (2, 1, 2, 1, False, False, "p2p", GPT2_STYLE),
    (2, 1, 2, 1, False, False, "allgather", LLAMA_STYLE),
    (2, 1, 2, 1, False, False, "a2a", LLAMA_STYLE),
    (4, 1, 4, 1, False, False, "p2p", LLAMA_STYLE),
    (4, 1, 4, 1, False, False, "allgather", GPT2_STYLE),
    (4, 1, 4, 1, False, False, "a2a", GPT2_STYLE),
    (4, 2, 2, 1, True, False, "p2p", LLAMA_STYLE),
    (4, 1, 2, 2, False, False, "p2p", GPT2_STYLE),
    (4, 1, 2, 1, False, True, "p2p", LLAMA_STYLE),
]
IDS = ["cp2-p2p", "cp2-allgather-gqa-rope", "cp2-a2a-gqa-rope", "cp4-p2p-gqa-rope", "cp4-allgather",
       "cp4-a2a", "cp2-tp2-sp-gqa-rope", "cp2-pp2", "cp2-dp2-distopt-gqa-rope"]


@pytest.mark.parametrize("world,tp,cp,pp,sp,dist_opt,comm,style", LAYOUTS, ids=IDS)
def test_context_parallel_equals_one_process(world, tp, cp, pp, sp, dist_opt, comm, style):
    checked = run_ranks(_cp_parity, world, tp, cp, pp, sp, dist_opt, comm, style, timeout=240)
    assert sum(checked) > 0


FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.mark.parametrize("world,comm,extra", [
    (2, "p2p", FULL_RECOMPUTE), (2, "allgather", dict(recompute_granularity="selective")),
    (4, "a2a", dict(calculate_per_token_loss=True))],
    ids=["p2p-full-recompute", "allgather-selective-recompute", "cp2-dp2-a2a-per-token-loss"])
def test_context_parallel_with_recompute_or_per_token_loss_equals_one_process(world, comm, extra):
    run_ranks(_cp_parity, world, 1, 2, 1, False, False, comm, LLAMA_STYLE, extra, timeout=240)


def _cp2_llama(comm, **overrides):
    return tiny_config(style=LLAMA_STYLE, dp=2, vocab_size=112, micro_batch_size=MICRO, num_layers=2,
                       global_batch_size=MICRO, context_parallel_size=2, cp_comm_type=comm, **overrides)


def _grads_with_dropout(rank, world, comm, recompute):
    cfg = _cp2_llama(comm, hidden_dropout=0.2, attention_dropout=0.2, **(recompute or {}))
    state = driver_state(cfg, torch.float64)
    state.optimizer.zero_grad()
    logs = run_schedule(state, _micro_batches(state.cfg, 0, 1, 1), forward_only=False)
    grads = {n: p.main_grad.clone() for n, p in state.model[0].module.named_parameters()}
    return logs[0]["lm loss"].item(), grads


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_dropout_masks_replay_under_recompute(comm):
    """Same seeds, dropout on: recomputed attention (selective) and recomputed layers (full) draw
    exactly the masks of the run that keeps its activations."""
    plain = run_ranks(_grads_with_dropout, 2, comm, None, timeout=120)
    for recompute in (dict(recompute_granularity="selective"), FULL_RECOMPUTE):
        again = run_ranks(_grads_with_dropout, 2, comm, recompute, timeout=120)
        for (loss, grads), (loss2, grads2) in zip(plain, again):
            assert abs(loss - loss2) < TOL
            assert all((grads[n] - grads2[n]).abs().max() < TOL for n in grads)
    no_dropout = run_ranks(_loss_without_dropout, 2, comm, timeout=120)
    assert abs(plain[0][0] - no_dropout[0]) > 1e-6  # dropout did act


def _loss_without_dropout(rank, world, comm):
    state = driver_state(_cp2_llama(comm), torch.float64)
    return run_schedule(state, _micro_batches(state.cfg, 0, 1, 1), forward_only=True)[0]["lm loss"].item()
