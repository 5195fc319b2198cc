"""Optimizer and loss flags through the driver's train_step, float64 against written-out
references: --optimizer sgd (torch SGD), --decoupled-lr (megatron-core's scheduler),
--calculate-per-token-loss (the global token mean), --grad-reduce-in-bf16 (bf16 reduction)."""

import warnings

import pytest
import torch
import torch.distributed as dist

from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.model.gpt import masked_mean_loss
from megafab.optim.lr_scheduler import OptimizerParamScheduler
from megafab.run.fork_ranks import run_ranks
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from megafab.training.step import train_step
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, batch, reference_model, tiny_config

STEPS, MICRO = 3, 2


def _samples(model_cfg, count, seed=100):
    out = []
    for i in range(count):
        tokens, labels, mask = batch(model_cfg, micro_batch=1, seed=seed + i)
        out.append({"tokens": tokens[0], "labels": labels[0], "loss_mask": mask[0]})
    return out


def _micro_batches(samples, start, dp_rank, dp, count):
    """Megatron's sampler: micro-batch k of DP rank d is samples [k*b*dp + d*b, ... + b)."""
    for k in range(count):
        lo = start + k * MICRO * dp + dp_rank * MICRO
        yield {key: torch.stack([s[key] for s in samples[lo:lo + MICRO]]) for key in samples[0]}


def _driver(cfg, dtype=torch.float64):
    p = cfg.parallel
    topo = build_topology(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker, dtype=dtype)
    optimizer = build_optimizer(cfg, topo, model)
    return TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))


def _train(state, samples, gbs):
    losses = []
    for step in range(STEPS):
        data = _micro_batches(samples, step * gbs, state.topology.dp_rank, state.topology.dp,
                              state.cfg.training.num_micro_batches)
        losses.append(train_step(state, data)["lm loss"])
    return losses


def _params(state):
    return {n: p.detach().clone() for n, p in state.model[0].module.named_parameters()}


def _reference_sgd(cfg, samples, gbs, per_token: bool):
    """One process, torch.optim.SGD with Megatron's groups (no weight decay on biases/1-D params)."""
    o = cfg.optimizer
    model = reference_model(cfg.model)
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    plain = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": o.weight_decay},
                           {"params": plain, "weight_decay": 0.0}], lr=o.lr, momentum=o.sgd_momentum)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        micro = list(_micro_batches(samples, step * gbs, 0, 1, gbs // MICRO))
        sums = [(model(mb["tokens"], labels=mb["labels"]) * mb["loss_mask"]).sum() for mb in micro]
        tokens = [mb["loss_mask"].sum() for mb in micro]
        if per_token:  # every token of the global batch weighs the same
            loss = sum(sums) / sum(tokens)
        else:  # Megatron's default: mean over micro-batches of each one's token mean
            loss = sum(s / n for s, n in zip(sums, tokens)) / len(micro)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        assert norm > 0
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sgd_parity(rank, world, momentum, per_token, dist_opt, style):
    dp, gbs = world, MICRO * world * 2
    common = dict(style=style, vocab_size=112, lr=0.05, clip_grad=0.5, weight_decay=0.1, optimizer="sgd",
                  sgd_momentum=momentum, lr_decay_style="constant", micro_batch_size=MICRO,
                  global_batch_size=gbs, train_iters=STEPS, calculate_per_token_loss=per_token)
    cfg = tiny_config(dp=dp, use_distributed_optimizer=dist_opt, **common)
    samples = _samples(cfg.model, gbs * STEPS)
    ref_losses, ref_params = _reference_sgd(tiny_config(**common), samples, gbs, per_token)
    state = _driver(cfg)
    losses = _train(state, samples, gbs)
    assert type(state.optimizer.optimizer) is torch.optim.SGD
    for ours, ref in zip(losses, ref_losses):
        assert abs(ours - ref) < 1e-12, (losses, ref_losses)
    for name, p in _params(state).items():
        err = (p - ref_params[name]).abs().max().item()
        assert err < 1e-12, (name, err)
    return losses


@pytest.mark.parametrize("momentum,per_token,dist_opt,style", [
    (0.9, False, False, GPT2_STYLE), (0.0, False, True, LLAMA_STYLE), (0.9, True, True, GPT2_STYLE)],
    ids=["sgd-momentum", "sgd-no-momentum-distopt-llama", "sgd-per-token-loss-distopt"])
def test_sgd_through_the_driver_equals_torch_sgd(momentum, per_token, dist_opt, style):
    losses = run_ranks(_sgd_parity, 2, momentum, per_token, dist_opt, style, timeout=240)[0]
    assert len(losses) == STEPS


def _adam_losses(rank, world):
    gbs = MICRO * world * 2
    common = dict(vocab_size=112, lr=0.05, micro_batch_size=MICRO, global_batch_size=gbs,
                  train_iters=STEPS, lr_decay_style="constant")
    samples = _samples(tiny_config(**common).model, gbs * STEPS)
    out = {}
    for name in ("adam", "sgd"):
        out[name] = _train(_driver(tiny_config(dp=world, optimizer=name, **common)), samples, gbs)
    return out


def test_sgd_and_adam_train_differently():
    out = run_ranks(_adam_losses, 2, timeout=240)[0]
    assert out["adam"][0] == pytest.approx(out["sgd"][0], abs=1e-12)  # same model, same first batch
    assert abs(out["adam"][-1] - out["sgd"][-1]) > 1e-3


def test_per_token_loss_differs_from_the_micro_batch_mean():
    # the masks hold different token counts, so the two weightings are different losses
    common = dict(vocab_size=112, micro_batch_size=MICRO, global_batch_size=4, train_iters=STEPS,
                  optimizer="sgd", lr=0.05, lr_decay_style="constant")
    samples = _samples(tiny_config(**common).model, 4 * STEPS)
    per_token, _ = _reference_sgd(tiny_config(calculate_per_token_loss=True, **common), samples, 4, True)
    mean, _ = _reference_sgd(tiny_config(**common), samples, 4, False)
    assert abs(per_token[0] - mean[0]) > 1e-6


def test_decoupled_lr_schedule_equals_megatron_core():
    """Embedding and output layer follow --decoupled-lr / --decoupled-min-lr, the rest --lr / --min-lr,
    step by step as megatron-core's OptimizerParamScheduler computes them."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as MegatronScheduler

    cfg = tiny_config(style=LLAMA_STYLE, lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3, decoupled_min_lr=4e-4,
                      lr_decay_style="cosine", lr_warmup_iters=2, train_iters=10, micro_batch_size=2)
    model = reference_model(cfg.model)
    opt = build_optimizer(cfg, None, [model])
    decoupled = {id(p) for g in opt.param_groups if "max_lr" in g for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decoupled}
    assert names == {"embedding.word_embeddings.weight", "output_layer.weight"}
    ours = build_scheduler(cfg, opt)
    assert isinstance(ours, OptimizerParamScheduler)
    fake = [{"max_lr": g.get("max_lr", 1e-3), "min_lr": g.get("min_lr", 1e-4), "lr_mult": 1.0,
             "wd_mult": g["wd_mult"], "weight_decay": 0.0} for g in opt.param_groups]

    class Holder:
        param_groups = fake

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = MegatronScheduler(Holder(), init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=4,
                                   lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                   wd_incr_steps=20, wd_incr_style="constant")
    gbs = cfg.training.global_batch_size
    for _ in range(10):
        for ours_group, their_group in zip(opt.param_groups, fake):
            assert ours_group["lr"] == pytest.approx(their_group["lr"], rel=1e-12)
        ours.step(gbs)
        theirs.step(gbs)
    assert len({g["lr"] for g in opt.param_groups}) == 2  # two schedules ran, not one


def _bf16_reduction(rank, world, flag):
    # The reference grads below come from plain autograd; gradient accumulation fusion computes the
    # same bf16 weight-gradient GEMM transposed (go^T x, not (x^T go)^T), which rounds differently.
    cfg = tiny_config(dp=world, bf16=True, grad_reduce_in_bf16=flag, vocab_size=112,
                      micro_batch_size=MICRO, global_batch_size=MICRO * world, train_iters=1, lr=1e-3,
                      gradient_accumulation_fusion=False)
    state = _driver(cfg, dtype=torch.bfloat16)
    ddp = state.model[0]
    tokens, labels, mask = batch(cfg.model, micro_batch=MICRO, seed=rank)

    # this rank's own gradient, in the grad buffer's dtype, before any reduction
    local_model = reference_model(cfg.model)
    local_model.to(torch.bfloat16)
    masked_mean_loss(local_model(tokens, labels=labels), mask.to(torch.bfloat16)).backward()
    local = {n: p.grad.to(ddp.grad_dtype) for n, p in local_model.named_parameters()}
    gathered = {}
    for n, g in local.items():
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g)
        gathered[n] = parts
    state.optimizer.zero_grad()
    masked_mean_loss(ddp(tokens, labels=labels), mask.to(torch.bfloat16)).backward()
    ddp.finish_grad_sync()
    for n, p in ddp.module.named_parameters():
        expected = sum(part * (1.0 / world) for part in gathered[n])  # pre-divided, summed in dtype
        assert p.main_grad.dtype == ddp.grad_dtype
        assert torch.equal(p.main_grad, expected.to(ddp.grad_dtype)), n
    return str(ddp.grad_dtype)


@pytest.mark.parametrize("flag,dtype", [(True, "torch.bfloat16"), (False, "torch.float32")])
def test_grad_reduce_in_bf16_reduces_bf16_gradients(flag, dtype):
    assert run_ranks(_bf16_reduction, 2, flag, timeout=240) == [dtype, dtype]
