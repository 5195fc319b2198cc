"""A GPT with multi-token prediction split over pipeline stages (MTP on the last stage's last chunk:
1F1B and interleaved) and over TP x SP equals one process in float64: the main loss, each depth's
logged MTP loss and every gradient (the last stage's copy of the word embedding included, tied and
untied), within 1e-10; and under context parallelism (the ids, positions, labels and loss mask rolled
across the CP ranks' chunks, each depth's loss the whole sequence's mean)."""

import functools

import pytest
import torch
import torch.distributed as dist

from megafab.distributed.context_parallel import context_parallel_masked_mean, split_for_context_parallel
from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.pipeline import get_forward_backward_func
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, build_model_chunks, masked_mean_loss
from megafab.model.transformer import LayerContext
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import (
    GPT2_STYLE,
    LLAMA_STYLE,
    batch,
    context,
    full_grad,
    loss_func,
    reduce_sequence_parallel_grads,
    reference_model,
    tiny_config,
)

MICRO_BATCHES = 4
TIED = {**LLAMA_STYLE, "untie_embeddings_and_output_weights": False}


def forward_step(data_iterator, model):
    tokens, labels, mask = next(data_iterator)
    return model(tokens, labels=labels, loss_mask=mask), functools.partial(loss_func, mask)


def _reference(cfg, batches):
    """Loss, per-depth logged losses (summed over micro-batches) and grads of one process."""
    model = reference_model(cfg)
    model.mtp.loss_scale.set(1.0 / len(batches))  # what the schedule's 1/micro-batches gives the main loss
    losses = [masked_mean_loss(model(t, labels=lab, loss_mask=m), m) for t, lab, m in batches]
    total = sum(losses) / len(batches)
    total.backward()
    return total.item(), model.mtp.take_logged_losses(), {n: p.grad for n, p in model.named_parameters()}


def _pipeline(rank, world, layouts):
    out = []
    for pp, vpp, style, depths in layouts:
        topo = build_topology(pp=pp, vpp=vpp)
        cfg = tiny_config(pp=pp, style=style, mtp_num_layers=depths).model
        batches = [batch(cfg, seed=i) for i in range(MICRO_BATCHES)]
        ref_loss, ref_logged, ref_grads = _reference(cfg, batches)
        chunks = build_model_chunks(cfg, context(), pp, topo.pp_rank, vpp)
        assert [hasattr(c, "mtp") for c in chunks] == \
            [topo.is_last_stage and c == vpp - 1 for c in range(vpp)]
        for c in chunks:
            if hasattr(c, "mtp"):
                c.mtp.loss_scale.set(1.0 / MICRO_BATCHES)  # training/mtp.py's mtp_loss_scale
        logs = get_forward_backward_func(pp, vpp)(
            forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
            model=chunks if vpp > 1 else chunks[0], num_microbatches=MICRO_BATCHES,
            seq_length=cfg.seq_length, micro_batch_size=2, hidden_size=cfg.hidden_size, topology=topo,
            dtype=torch.float64,
            finalize_model_grads_func=functools.partial(finalize_model_grads, topology=topo))
        if topo.is_last_stage:
            loss = sum(log["lm loss"].item() for log in logs) / len(logs)
            assert abs(loss - ref_loss) < 1e-10, (pp, vpp, loss, ref_loss)
            logged = chunks[-1].mtp.take_logged_losses()
            assert logged.shape == (depths,) and (logged - ref_logged).abs().max() < 1e-10
        names = []
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                err = (p.grad - ref_grads[name]).abs().max().item()
                assert err < 1e-10, (pp, vpp, name, err)
                names.append(name)
        out.append(names)
    return out


def test_mtp_on_the_last_pipeline_stage_equals_single_process():
    layouts = [(2, 1, LLAMA_STYLE, 2), (2, 1, TIED, 1), (2, 2, TIED, 2)]
    names = run_ranks(_pipeline, 2, layouts, timeout=240)
    for i in range(len(layouts)):
        first, last = names[0][i], names[1][i]
        assert not any(n.startswith("mtp.") for n in first) and any(n.startswith("mtp.") for n in last)
        # the last stage embeds for MTP: its copy of the word embedding got the summed gradient
        assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" in last
        assert ("output_layer.weight" in last) == (layouts[i][2] is LLAMA_STYLE)


def _tensor_parallel(rank, world):
    topo = build_topology(tp=world)
    tp_group = topo.group("tp")
    checked = []
    for style, depths in ((LLAMA_STYLE, 1), (TIED, 2)):
        cfg = tiny_config(tp=world, style=style, mtp_num_layers=depths).model
        tokens, labels, mask = batch(cfg)
        ref = reference_model(cfg)
        ref_loss = masked_mean_loss(ref(tokens, labels=labels, loss_mask=mask), mask)
        ref_loss.backward()
        ref_logged = ref.mtp.take_logged_losses()
        for sp in (False, True):
            model = GPTModel(cfg, context(tp_group, sp))
            loss = masked_mean_loss(model(tokens, labels=labels, loss_mask=mask), mask)
            loss.backward()
            if sp:
                reduce_sequence_parallel_grads(model, tp_group)
            assert abs(loss.item() - ref_loss.item()) < 1e-10
            assert (model.mtp.take_logged_losses() - ref_logged).abs().max() < 1e-10
            assert model.mtp.layers["0"].eh_proj.weight.shape[0] == cfg.hidden_size // world
            for name, p in ref.named_parameters():
                err = (full_grad(dict(model.named_parameters())[name], tp_group) - p.grad).abs().max().item()
                assert err < 1e-10, (sp, name, err)
            checked.append(sp)
    return checked


def test_mtp_under_tensor_and_sequence_parallel_equals_single_process():
    assert run_ranks(_tensor_parallel, 2, timeout=120) == [[False, True, False, True]] * 2


def test_full_uniform_recompute_of_the_mtp_layers_changes_no_gradient():
    """megatron-core checkpoints each MTP depth whole under uniform full recompute: the same loss,
    MTP losses and gradients, bit for bit."""
    results = []
    for recompute in ({}, dict(recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1)):
        cfg = tiny_config(style=LLAMA_STYLE, mtp_num_layers=2, hidden_dropout=0.1, **recompute).model
        model = reference_model(cfg)
        assert all(layer.recompute == bool(recompute) for layer in model.mtp.layers.values())
        tokens, labels, mask = batch(cfg)
        torch.manual_seed(5)  # the same dropout masks (the recompute replays the RNG)
        loss = masked_mean_loss(model(tokens, labels=labels, loss_mask=mask), mask)
        loss.backward()
        results.append((loss.item(), model.mtp.take_logged_losses(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss0, logged0, grads0), (loss1, logged1, grads1) = results
    assert loss0 == loss1 and torch.equal(logged0, logged1)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)


def _context_parallel(rank, world, comm):
    topo = build_topology(cp=world)
    group = topo.group("cp")
    checked = []
    for style in (LLAMA_STYLE, GPT2_STYLE):  # RoPE; learned positions (MTP embeds rolled positions)
        cfg = tiny_config(style=style, mtp_num_layers=2).model
        tokens, labels, mask = batch(cfg)
        ref = reference_model(cfg)
        ref_loss = masked_mean_loss(ref(tokens, labels=labels, loss_mask=mask), mask)
        ref_loss.backward()
        ref_logged = ref.mtp.take_logged_losses()
        ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, cp_group=group,
                           cp_comm_type=comm)
        model = GPTModel(cfg, ctx)

        def local(t):
            return split_for_context_parallel(t, 1, dist.get_rank(group), world)

        loss = context_parallel_masked_mean(model(local(tokens), labels=local(labels), loss_mask=local(mask)),
                                            local(mask), group)
        loss.backward()
        assert abs(loss.item() - ref_loss.item()) < 1e-10
        assert (model.mtp.take_logged_losses() - ref_logged).abs().max() < 1e-10
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad, group=group)  # DP x CP's gradient average (over CP here)
            err = (p.grad / world - dict(ref.named_parameters())[name].grad).abs().max().item()
            assert err < 1e-10, (comm, name, err)
        checked.append(style["position_embedding_type"])
    return checked


@pytest.mark.parametrize("comm", ["p2p", "allgather", "a2a"])
def test_mtp_under_context_parallelism_equals_single_process(comm):
    assert run_ranks(_context_parallel, 2, comm, timeout=120) == [["rope", "learned_absolute"]] * 2
