"""A GPT with sliding-window attention on some layers (--window-attn-skip-freq) and learnable
attention sinks under TP 2 (with and without SP, and with selective core_attn recompute), PP 2 and
CP 2 (allgather and a2a windows; p2p with sinks only) equals the single-process model in float64:
the loss and every gradient within 1e-10, the sinks' (softmax_offset, split over TP by heads) too."""

from __future__ import annotations

import functools

import pytest
import torch

from megafab.distributed.context_parallel import context_parallel_masked_mean, split_for_context_parallel
from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.masked_attention import attention, bottom_right_positions, window_mask
from megafab.distributed.pipeline import get_forward_backward_func
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, build_model_chunks, masked_mean_loss
from megafab.model.transformer import LayerContext
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import (
    LLAMA_STYLE,
    batch,
    context,
    forward_step,
    full_grad,
    reduce_sequence_parallel_grads,
    reference_model,
    tiny_config,
)

STYLE = dict(LLAMA_STYLE, rotary_percent=1.0, window_size=(3, 0), window_attn_skip_freq=(1, 0, 1, 1),
             softmax_type="learnable")
SINK = "decoder.layers.0.self_attention.core_attention.softmax_offset"


def loss_and_grads(model, tokens, labels, mask, tp_group=None):
    loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    if model.ctx.sequence_parallel:
        reduce_sequence_parallel_grads(model, tp_group)
    return loss.item(), {n: full_grad(p, tp_group) for n, p in model.named_parameters()}


def _compare(loss, grads, ref_loss, ref_grads):
    assert abs(loss - ref_loss) < 1e-10, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and SINK in grads
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() < 1e-10, name
    return len(grads)


def _tp_parity(rank, world):
    topo = build_topology(tp=world)
    checked = []
    for recompute in ({}, dict(recompute_granularity="selective", recompute_modules=["core_attn"])):
        cfg = tiny_config(tp=world, style=STYLE, **recompute).model
        tokens, labels, mask = batch(cfg)
        ref = loss_and_grads(reference_model(cfg), tokens, labels, mask)
        for sp in (False, True):
            model = GPTModel(cfg, context(topo.group("tp"), sp))
            sink = model.decoder.layers["0"].self_attention.core_attention.softmax_offset
            assert sink.shape == (cfg.num_attention_heads // world,) and sink.partition_dim == 0
            checked.append(_compare(*loss_and_grads(model, tokens, labels, mask, topo.group("tp")), *ref))
    return checked


def test_tensor_and_sequence_parallel_equal_single_process():
    checked = run_ranks(_tp_parity, 2, timeout=120)
    assert all(len(c) == 4 and min(c) > 0 for c in checked)


def _pipeline_parity(rank, world):
    topo = build_topology(pp=world)
    cfg = tiny_config(pp=world, style=dict(STYLE, window_attn_skip_freq=2)).model
    batches = [batch(cfg, seed=i) for i in range(2)]
    reference = reference_model(cfg)
    ref_loss = sum(masked_mean_loss(reference(t, labels=lab), m) for t, lab, m in batches) / len(batches)
    ref_loss.backward()
    chunks = build_model_chunks(cfg, context(), world, topo.pp_rank, 1)
    windows = [layer.self_attention.core_attention.window for layer in chunks[0].decoder.layers.values()]
    assert windows == [3, None]  # layers 1 and 3 (1-based) windowed on both stages
    logs = get_forward_backward_func(world, 1)(
        forward_step_func=forward_step, data_iterator=iter(batches), model=chunks[0],
        num_microbatches=len(batches), seq_length=cfg.seq_length, micro_batch_size=2,
        hidden_size=cfg.hidden_size, topology=topo, dtype=torch.float64, sequence_parallel=False,
        finalize_model_grads_func=functools.partial(finalize_model_grads, topology=topo,
                                                    sequence_parallel=False))
    if topo.is_last_stage:
        loss = sum(log["lm loss"].item() for log in logs) / len(logs)
        assert abs(loss - ref_loss.item()) < 1e-10, (loss, ref_loss.item())
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    grads = {n: p.grad for n, p in chunks[0].named_parameters()}
    assert any(n.endswith("softmax_offset") for n in grads)
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() < 1e-10, name
    return len(grads)


def test_pipeline_parallel_equals_single_process():
    assert min(run_ranks(_pipeline_parity, 2, timeout=120)) > 0


def _cp_parity(rank, world, comm, style):
    topo = build_topology(cp=world)
    cfg = tiny_config(style=style).model  # the layout is the context's
    tokens, labels, mask = batch(cfg)
    ref_loss, ref_grads = loss_and_grads(reference_model(cfg), tokens, labels, mask)
    group = topo.group("cp")
    ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, cp_group=group,
                       cp_comm_type=comm)
    model = GPTModel(cfg, ctx)

    def local(t):
        return split_for_context_parallel(t, 1, rank, world)

    loss = context_parallel_masked_mean(model(local(tokens), labels=local(labels)), local(mask), group)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        torch.distributed.all_reduce(p.grad, group=group)
        grads[name] = p.grad / world
    return _compare(loss.item(), grads, ref_loss, ref_grads)


@pytest.mark.parametrize("comm,style", [("allgather", STYLE), ("a2a", dict(STYLE, num_query_groups=4)),
                                        ("p2p", dict(STYLE, window_size=None, window_attn_skip_freq=None))])
def test_context_parallel_equals_single_process(comm, style):
    assert min(run_ranks(_cp_parity, 2, comm, style, timeout=120)) > 0


def test_window_and_document_masks_combine():
    """--reset-attention-mask's documents and the window: a key must be in both (each document
    attends as a sequence of its own would)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    documents = torch.tensor([0] * 5 + [1] * 7)
    other_document = (documents[:, None] != documents[None, :])[None, None]
    window = window_mask(*bottom_right_positions(12, 12), 2)
    sink = torch.tensor([0.3, -0.2], dtype=torch.float64)
    both = attention(q, k, v, other_document | window, sink)
    for part in (slice(0, 5), slice(5, 12)):
        n = part.stop - part.start
        alone = attention(q[:, :, part], k[:, :, part], v[:, :, part],
                          window_mask(*bottom_right_positions(n, n), 2), sink)
        assert (both[:, :, part] - alone).abs().max().item() < 1e-14
