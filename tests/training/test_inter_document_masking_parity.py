"""--dataloader-inter-document-masking equals one process in float64: through the driver's train_step
(samples carrying cu_seqlens and per-document position_ids, the mask made per micro-batch as
pretrain makes it; 3 AdamW steps, two micro-batches of 2 packed samples each) at TP 2 + SP, PP 2
and CP 2 (allgather, a2a: each rank's queries masked by their rows of the whole sequence's document
mask), the grad norm of every step and every parameter after it within 1e-10; and the loss and every
gradient of one forward-backward at TP 2 (with and without SP) and CP 2 within 1e-10, also with sliding
windows and learnable sinks and (CP) with multi-latent attention."""

import pytest
import torch

from megafab.data.packed_documents import attach_document_mask
from megafab.distributed.context_parallel import context_parallel_masked_mean, split_for_context_parallel
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.transformer import LayerContext
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import get_batch_on_this_cp_rank
from tests.helpers.driver import MICRO, STEPS, driver_state, make_samples, reference_run, train_and_compare
from tests.helpers.mcore_mla import MLA_STYLE
from tests.helpers.packed_documents import packed_fields
from tests.helpers.tiny import (
    LLAMA_STYLE,
    batch,
    context,
    full_grad,
    reduce_sequence_parallel_grads,
    reference_model,
    tiny_config,
)

STYLE = dict(LLAMA_STYLE, rotary_percent=1.0, num_query_groups=2, seq_length=32, vocab_size=112,
             dataloader_inter_document_masking=True)
# one forward-backward: the plain model, sliding windows with learnable sinks (the document mask
# combined with each windowed layer's window), multi-latent attention (CP only)
DIRECT = {"plain": STYLE, "window_sinks": dict(STYLE, window_size=(4, 0), window_attn_skip_freq=2,
                                               softmax_type="learnable"),
          "mla": dict(MLA_STYLE, seq_length=32, vocab_size=112, dataloader_inter_document_masking=True)}
LAYOUTS = {"tp2-sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2),
           "cp2-allgather": dict(context_parallel_size=2, cp_comm_type="allgather"),
           "cp2-a2a": dict(context_parallel_size=2, cp_comm_type="a2a")}


def packed_samples(m, count):
    return [(tokens, labels, mask, packed_fields(m.seq_length, 700 + i, documents=3 + i % 3))
            for i, (tokens, labels, mask) in enumerate(make_samples(m, count))]


def _driver(rank, world, layout):
    layout = dict(layout)
    tp, pp = layout.pop("tp", 1), layout.pop("pp", 1)
    dp = world // (tp * pp * layout.get("context_parallel_size", 1))
    gbs = MICRO * dp * 2
    cfg = tiny_config(tp=tp, pp=pp, style=STYLE, dp=world // (tp * pp), micro_batch_size=MICRO,
                      global_batch_size=gbs, lr=1e-2, lr_decay_style="constant", train_iters=STEPS, **layout)
    samples = packed_samples(cfg.model, gbs * STEPS)
    reference = reference_run(tiny_config(style=STYLE, lr=1e-2), samples, gbs)
    return train_and_compare(driver_state(cfg, torch.float64), samples, reference, gbs)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS)
def test_driver_equals_single_process(layout):
    losses = [loss for loss in run_ranks(_driver, 2, layout, timeout=180) if loss is not None]  # last stages
    assert losses and all(loss > 0 for loss in losses)


def packed_micro_batch(m):
    tokens, labels, mask = batch(m, micro_batch=2, seed=5)
    fields = [packed_fields(m.seq_length, 40 + i) for i in range(2)]
    return dict(tokens=tokens, labels=labels, loss_mask=mask,
                **{k: torch.stack([f[k] for f in fields]) for k in fields[0]})


def _compare(loss, grads, ref_loss, ref_grads):
    assert abs(loss - ref_loss) < 1e-10, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() < 1e-10, name
    return len(grads)


def _reference(m, mb):
    model = reference_model(m)
    loss = masked_mean_loss(model(mb["tokens"], mb["position_ids"], labels=mb["labels"],
                                  attention_mask=mb["attention_mask"]), mb["loss_mask"])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _direct(rank, world, style):
    m = tiny_config(style=DIRECT[style]).model
    mb = attach_document_mask(packed_micro_batch(m))
    ref = _reference(m, mb)
    checked = []
    topo = build_topology(tp=world)
    tp = topo.group("tp")
    for sp in (False, True) if style != "mla" else ():
        model = GPTModel(m, context(tp, sp))
        loss = masked_mean_loss(model(mb["tokens"], mb["position_ids"], labels=mb["labels"],
                                      attention_mask=mb["attention_mask"]), mb["loss_mask"])
        loss.backward()
        if sp:
            reduce_sequence_parallel_grads(model, tp)
        grads = {n: full_grad(p, tp) for n, p in model.named_parameters()}
        checked.append(_compare(loss.item(), grads, *ref))
    cp = build_topology(cp=world).group("cp")
    for comm in ("allgather", "a2a"):
        ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, cp_group=cp,
                           cp_comm_type=comm)
        model = GPTModel(m, ctx)
        local = get_batch_on_this_cp_rank(mb, cp)
        assert local["attention_mask"].shape[-2:] == (m.seq_length, m.seq_length)  # the whole sequence's
        assert torch.equal(local["tokens"], split_for_context_parallel(mb["tokens"], 1, rank, world))
        per_token = model(local["tokens"], local["position_ids"], labels=local["labels"],
                          attention_mask=local["attention_mask"])
        loss = context_parallel_masked_mean(per_token, local["loss_mask"], cp)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            torch.distributed.all_reduce(p.grad, group=cp)
            grads[name] = p.grad / world
        checked.append(_compare(loss.item(), grads, *ref))
    return checked


@pytest.mark.parametrize("style", DIRECT)
def test_loss_and_every_gradient_equal_single_process(style):
    checked = run_ranks(_direct, 2, style, timeout=120)
    assert all(len(c) == (2 if style == "mla" else 4) and min(c) > 0 for c in checked)
