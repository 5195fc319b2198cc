"""The GPT split over pipeline stages (1F1B, interleaved) and TP x SP equals one process (float64)."""

import functools

import pytest
import torch

from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.pipeline import get_forward_backward_func
from megafab.distributed.topology import build_topology
from megafab.model.gpt import WORD_EMBEDDING, build_model_chunks, masked_mean_loss
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import (
    GPT2_STYLE,
    LLAMA_STYLE,
    batch,
    context,
    forward_step,
    full_grad,
    reference_model,
    tiny_config,
)

MICRO_BATCHES = 4


def _reference(cfg, batches):
    model = reference_model(cfg)
    total = sum(masked_mean_loss(model(t, labels=lab), m) for t, lab, m in batches) / len(batches)
    total.backward()
    return total.item(), {n: p.grad for n, p in model.named_parameters()}


def _pipeline_parity(rank, world, layouts):
    results = []
    for tp, pp, vpp, sp, style in layouts:
        topo = build_topology(tp=tp, pp=pp, vpp=vpp)
        cfg = tiny_config(tp=tp, pp=pp, style=style).model
        batches = [batch(cfg, seed=i) for i in range(MICRO_BATCHES)]
        ref_loss, ref_grads = _reference(cfg, batches)
        tp_group = topo.group("tp") if tp > 1 else None
        chunks = build_model_chunks(cfg, context(tp_group, sp), pp, topo.pp_rank, vpp)
        schedule = get_forward_backward_func(pp, vpp)
        logs = schedule(
            forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
            model=chunks if vpp > 1 else chunks[0], num_microbatches=MICRO_BATCHES,
            seq_length=cfg.seq_length, micro_batch_size=2, hidden_size=cfg.hidden_size, topology=topo,
            dtype=torch.float64, sequence_parallel=sp,
            finalize_model_grads_func=functools.partial(finalize_model_grads, topology=topo,
                                                        sequence_parallel=sp))
        if topo.is_last_stage:
            loss = sum(log["lm loss"].item() for log in logs) / len(logs)
            assert abs(loss - ref_loss) < 1e-10, (tp, pp, vpp, sp, loss, ref_loss)
        compared = 0
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                ref_name = WORD_EMBEDDING if name == "output_layer.weight" and \
                    not cfg.untie_embeddings_and_output_weights else name
                err = (full_grad(p, topo.group("tp") if tp > 1 else None) - ref_grads[ref_name]).abs().max()
                assert err < 1e-10, (tp, pp, vpp, sp, name, err.item())
                compared += 1
        results.append(compared)
    return results


LAYOUTS_2 = [(1, 2, 1, False, s) for s in (GPT2_STYLE, LLAMA_STYLE)] + \
            [(1, 2, 2, False, s) for s in (GPT2_STYLE, LLAMA_STYLE)]
LAYOUTS_4 = [(1, 4, 1, False, s) for s in (GPT2_STYLE, LLAMA_STYLE)] + \
            [(2, 2, 1, sp, s) for sp in (False, True) for s in (GPT2_STYLE, LLAMA_STYLE)] + \
            [(2, 2, 2, True, GPT2_STYLE)]


@pytest.mark.parametrize("world,layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)], ids=["pp2-vpp2", "pp4-tp2pp2"])
def test_gpt_pipeline_layouts_equal_single_process(world, layouts):
    compared = run_ranks(_pipeline_parity, world, layouts, timeout=240)
    # every rank checked every parameter it holds, in every layout
    assert all(len(r) == len(layouts) and min(r) > 0 for r in compared)
