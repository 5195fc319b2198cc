"""Activation recompute gives the loss and grads of no recompute (float64), bit-for-bit with dropout,
under TP2 x SP and PP2, and keeps fewer activations alive."""

import dataclasses
import functools

import pytest
import torch

from megafab.config import ConfigError
from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.pipeline import get_forward_backward_func
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, build_model_chunks, masked_mean_loss
from megafab.model.recompute import RecomputeConfigError, RecomputeSettings, layer_groups
from megafab.optim.memory import SavedActivations
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import (
    GPT2_STYLE,
    LLAMA_STYLE,
    batch,
    context,
    forward_step,
    full_grad,
    reduce_sequence_parallel_grads,
    reference_model,
    tiny_config,
)

SETTINGS = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-3": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    "selective": dict(recompute_granularity="selective"),
    "selective-modules": dict(recompute_granularity="selective",
                              recompute_modules=["core_attn", "layernorm", "mlp"]),
}
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)


def test_layer_groups_follow_megatron():
    def settings(method, n):
        return RecomputeSettings("full", method, n)
    assert layer_groups(4, settings("uniform", 2)) == [(0, 2, True), (2, 4, True)]
    assert layer_groups(5, settings("uniform", 2)) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert layer_groups(4, settings("block", 3)) == [(0, 1, True), (1, 2, True), (2, 3, True), (3, 4, False)]
    assert layer_groups(2, settings("block", 3)) == [(0, 1, True), (1, 2, True)]
    assert layer_groups(3, RecomputeSettings("selective", modules=("core_attn",))) == [(0, 3, False)]


def test_unsupported_recompute_module_is_refused_by_name():
    with pytest.raises(ConfigError, match="--recompute-modules moe_layer: not a module megatron-core"):
        tiny_config(recompute_granularity="selective", recompute_modules=["moe_layer"])
    cfg = dataclasses.replace(tiny_config().model, recompute_granularity="selective",
                              recompute_modules=["core_attn", "moe_layer"])  # a config the rules never saw
    with pytest.raises(RecomputeConfigError, match="--recompute-modules moe_layer: not a module"):
        GPTModel(cfg, context())


def _seeded_run(cfg, tp_group=None, sp=False, tp_rank=0):
    """Loss and full grads of one forward/backward with the RNG seeded as at initialize."""
    tracker = RNGStatesTracker("cpu")
    model = GPTModel(cfg, context(tp_group, sp, tracker=tracker))
    model_parallel_seed(1234, tp_rank, 0, "cpu", tracker)
    tokens, labels, mask = batch(cfg)
    loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    if sp:
        reduce_sequence_parallel_grads(model, tp_group)
    return loss.detach(), {n: full_grad(p, tp_group) for n, p in model.named_parameters()}


def _assert_same(run_a, run_b, tol, what):
    (loss_a, grads_a), (loss_b, grads_b) = run_a, run_b
    assert grads_a.keys() == grads_b.keys()
    if tol == 0:
        assert torch.equal(loss_a, loss_b), (what, loss_a.item(), loss_b.item())
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), (what, name)
    else:
        assert abs(loss_a.item() - loss_b.item()) < tol, (what, loss_a.item(), loss_b.item())
        for name in grads_a:
            err = (grads_a[name] - grads_b[name]).abs().max().item()
            assert err < tol, (what, name, err)


@pytest.mark.parametrize("style", [GPT2_STYLE, LLAMA_STYLE], ids=["gpt2", "llama"])
def test_recompute_with_dropout_is_bit_identical_to_no_recompute(style):
    baseline = _seeded_run(tiny_config(style=style, **DROPOUT).model)
    no_dropout = _seeded_run(tiny_config(style=style).model)
    assert baseline[0].item() != no_dropout[0].item()  # dropout really draws masks here
    for name, settings in SETTINGS.items():
        _assert_same(_seeded_run(tiny_config(style=style, **DROPOUT, **settings).model), baseline, 0, name)


def _tp_sp_recompute(rank, world):
    topo = build_topology(tp=world)
    checked = []
    for style in (GPT2_STYLE, LLAMA_STYLE):
        ref_cfg = tiny_config(tp=world, style=style).model
        tokens, labels, mask = batch(ref_cfg)
        ref_model = reference_model(ref_cfg)
        ref_loss = masked_mean_loss(ref_model(tokens, labels=labels), mask)
        ref_loss.backward()
        reference = (ref_loss.detach(), {n: p.grad for n, p in ref_model.named_parameters()})
        for name, settings in SETTINGS.items():
            cfg = tiny_config(tp=world, style=style, **settings).model
            _assert_same(_seeded_run(cfg, topo.group("tp"), True, topo.tp_rank), reference, 1e-10, name)
            with_dropout = tiny_config(tp=world, style=style, **DROPOUT, **settings).model
            baseline = _seeded_run(tiny_config(tp=world, style=style, **DROPOUT).model, topo.group("tp"),
                                   True, topo.tp_rank)
            _assert_same(_seeded_run(with_dropout, topo.group("tp"), True, topo.tp_rank), baseline, 0,
                         name + " dropout")
            checked.append(name)
    return checked


def test_recompute_under_tp2_and_sequence_parallel_equals_single_process():
    checked = run_ranks(_tp_sp_recompute, 2, timeout=120)
    assert checked[0] == list(SETTINGS) * 2


def _pp_recompute(rank, world):
    topo = build_topology(pp=world)
    ref_cfg = tiny_config(pp=world).model
    batches = [batch(ref_cfg, seed=i) for i in range(4)]
    ref_model = reference_model(ref_cfg)
    ref_loss = sum(masked_mean_loss(ref_model(t, labels=lab), m) for t, lab, m in batches) / len(batches)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
    compared = 0
    for settings in SETTINGS.values():
        cfg = tiny_config(pp=world, **settings).model
        chunk = build_model_chunks(cfg, context(), world, topo.pp_rank)[0]
        logs = get_forward_backward_func(world, 1)(
            forward_step_func=forward_step, data_iterator=iter(batches), model=chunk, num_microbatches=4,
            seq_length=cfg.seq_length, micro_batch_size=2, hidden_size=cfg.hidden_size, topology=topo,
            dtype=torch.float64, finalize_model_grads_func=functools.partial(
                finalize_model_grads, topology=topo, sequence_parallel=False))
        if topo.is_last_stage:
            loss = sum(log["lm loss"].item() for log in logs) / len(logs)
            assert abs(loss - ref_loss.item()) < 1e-10, (settings, loss)
        for name, p in chunk.named_parameters():
            ref_name = "embedding.word_embeddings.weight" if name == "output_layer.weight" else name
            assert (p.grad - ref_grads[ref_name]).abs().max() < 1e-10, (settings, name)
            compared += 1
    return compared


def test_recompute_under_pipeline_parallel_equals_single_process():
    compared = run_ranks(_pp_recompute, 2, timeout=120)
    assert all(c > 0 for c in compared)


def saved_activation_bytes(model, tokens, labels, mask) -> int:
    """Bytes of the distinct storages autograd keeps for backward, parameters excluded."""
    with SavedActivations(model.parameters()) as saved:
        loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    return saved.bytes


def measure_activation_memory(num_layers=12, dtype=torch.float32) -> dict[str, int]:
    out = {}
    base = dict(num_layers=num_layers, seq_length=32, vocab_size=128, **DROPOUT)  # tiny hidden, heads
    for name, settings in {"none": {}, **SETTINGS}.items():
        cfg = tiny_config(**base, **settings).model
        tracker = RNGStatesTracker("cpu")
        model_parallel_seed(1234, 0, 0, "cpu", tracker)
        model = GPTModel(cfg, context(tracker=tracker, dtype=dtype))
        out[name] = saved_activation_bytes(model, *batch(cfg, micro_batch=2))
    return out


def test_recompute_keeps_fewer_activations():
    measured = measure_activation_memory()
    print("saved activation bytes, 12 layers:", measured)
    assert measured["none"] >= 4 * measured["full-uniform-1"]
    assert measured["selective"] < measured["none"]
    assert measured["full-uniform-2"] < measured["full-uniform-1"]
    assert measured["full-uniform-1"] < measured["full-block-3"] < measured["none"]
