"""--overlap-param-gather: each bucket's all-gather is waited for by a forward pre-hook of the first
module that needs it, so the first layer's forward starts before the last bucket is waited for
(VPP 1 and 2); losses, evaluation and weights equal overlap off (float64, the driver's train_step).
"""

import os

import pytest
import torch

from megafab.checkpoint.checkpointing import save_checkpoint
from megafab.checkpoint.megatron_legacy import FILE
from megafab.checkpoint.state import gather_params
from megafab.distributed.param_gather import ParamGather, finish_param_syncs
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import evaluate, train_step
from tests.helpers.driver import driver_state
from tests.helpers.tiny import LLAMA_STYLE, batch, tiny_config

MICRO, STEPS = 2, 3


def _data(cfg, dp_rank, dp, step):
    """This DP rank's micro-batches of global batch `step` (Megatron's sampler order)."""
    for k in range(cfg.training.num_micro_batches):
        tokens, labels, mask = batch(cfg.model, micro_batch=MICRO, seed=1000 * step + k * dp + dp_rank)
        yield {"tokens": tokens, "labels": labels, "loss_mask": mask}


def _config(pp, vpp, overlap, **extra):
    dp = 2
    flat = dict(pp=pp, dp=dp, style=LLAMA_STYLE, vocab_size=112, micro_batch_size=MICRO,
                global_batch_size=MICRO * dp * 2 * pp, use_distributed_optimizer=True,
                overlap_grad_reduce=True, overlap_param_gather=overlap, ddp_bucket_size=1500,
                lr=1e-2, clip_grad=0.5, lr_decay_style="constant", train_iters=STEPS, **extra)
    if vpp > 1:
        flat["num_layers_per_virtual_pipeline_stage"] = 4 // (pp * vpp)
    return tiny_config(**flat)


def _record(state, log):
    """Log bucket waits and every layer's (and the final norm's) forward start, per chunk."""
    real_wait = ParamGather.wait  # the caller restores it

    def wait(gather, bucket):
        log.append(("wait", gathers.index(gather), bucket.index))
        real_wait(gather, bucket)
    gathers = [chunk.param_gather for chunk in state.model]
    ParamGather.wait = wait
    for c, chunk in enumerate(state.model):
        for number, layer in chunk.module.decoder.layers.items():
            layer.register_forward_pre_hook(lambda *_, c=c, n=int(number): log.append(("layer", c, n)))


def _run(state, with_eval):
    cfg, topo = state.cfg, state.topology
    losses, evals = [], []
    if with_eval:  # a forward before any step
        evals.append(evaluate(state, _data(cfg, topo.dp_rank, topo.dp, 99), 1, False))
    for step in range(STEPS):
        losses.append(train_step(state, _data(cfg, topo.dp_rank, topo.dp, step))["lm loss"])
    if with_eval:  # right after a step: stale buckets, none dispatched
        evals.append(evaluate(state, _data(cfg, topo.dp_rank, topo.dp, 98), 1, False))
    return losses, evals


def _weights(state):
    return [p.detach().clone() for chunk in state.model for p in chunk.module.parameters()]


def _overlap_matches_and_waits_late(rank, world, pp, vpp, save_dir):
    reference = driver_state(_config(pp, vpp, overlap=False), torch.float64)
    ref_losses, ref_evals = _run(reference, with_eval=True)
    ref_weights = _weights(reference)

    legacy = dict(save=save_dir, ckpt_format="torch", no_save_optim=True) if pp == 1 else {}
    state = driver_state(_config(pp, vpp, overlap=True, **legacy), torch.float64)
    cfg, topo = state.cfg, state.topology
    log, real_wait = [], ParamGather.wait
    losses = [train_step(state, _data(cfg, topo.dp_rank, topo.dp, 0))["lm loss"]]
    _record(state, log)
    losses.append(train_step(state, _data(cfg, topo.dp_rank, topo.dp, 1))["lm loss"])
    step_log = list(log)
    losses.append(train_step(state, _data(cfg, topo.dp_rank, topo.dp, 2))["lm loss"])
    # After the last step nothing is in flight; the other ranks' shards are not gathered yet.
    assert all(not chunk.param_gather.in_flight for chunk in state.model)
    assert all(chunk.param_gather.stale for chunk in state.model)
    stale = _weights(state)
    if legacy:  # a save (legacy: DP rank 0 writes whole tensors) gathers first
        saved = torch.load(os.path.join(save_checkpoint(state), "mp_rank_00", FILE), weights_only=False)
        names = [n for n, _ in state.model[0].module.named_parameters()]
        assert all(torch.equal(saved["model"][n], w) for n, w in zip(names, ref_weights))
    else:
        finish_param_syncs(state.model)
    weights = _weights(state)
    assert any(not torch.equal(a, b) for a, b in zip(stale, weights))
    assert losses == ref_losses, (losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))

    # Ordering within the recorded step, per chunk.
    for c, chunk in enumerate(state.model):
        buckets = chunk.param_gather.forward_order
        assert len(buckets) >= 3, len(buckets)
        waits = [i for i, e in enumerate(step_log) if e[:2] == ("wait", c)]
        assert sorted(step_log[i][2] for i in waits) == sorted(b.index for b in buckets)  # each once
        first_layer = min(int(n) for n in chunk.module.decoder.layers)
        start = step_log.index(("layer", c, first_layer))
        last_wait = next(i for i in waits if step_log[i][2] == buckets[-1].index)
        assert start < last_wait, step_log

    # Evaluation before any step and right after one, on a state whose weights were gathered as a
    # checkpoint load gathers them, before the first forward taught it the per-bucket plan.
    ParamGather.wait = real_wait
    evaluated = driver_state(_config(pp, vpp, overlap=True), torch.float64)
    gather_params(evaluated.model)
    _, evals = _run(evaluated, with_eval=True)
    assert evals == ref_evals, (evals, ref_evals)
    for chunk in evaluated.model:  # the chunk's pre-hook alone would wait for every bucket at once
        assert len(chunk.param_gather._hooks) > 1
        assert chunk.module not in chunk.param_gather._waits or \
            len(chunk.param_gather._waits[chunk.module]) < len(chunk.param_gather.buckets)
    return rank


@pytest.mark.parametrize("world,pp,vpp", [(2, 1, 1), (4, 2, 2)], ids=["dp2", "pp2-vpp2-dp2"])
def test_overlapped_param_gather_waits_per_bucket_in_the_forward_and_matches_overlap_off(
        world, pp, vpp, tmp_path):
    ranks = run_ranks(_overlap_matches_and_waits_late, world, pp, vpp, str(tmp_path), timeout=300)
    assert sorted(ranks) == list(range(world))
