"""Pipeline schedules give the single-process loss and gradients (float64, gloo, 1e-10)."""

import time

import pytest
import torch

from benchmarks.pipeline_toy import (
    build_chunks,
    forward_step,
    full_weights,
    make_batches,
    reference,
)
from megafab.distributed.p2p import PipelineShapeError, pipeline_tensor_shape
from megafab.distributed.pipeline import (
    PipelineScheduleError,
    custom_backward,
    deallocate_output_tensor,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)
from megafab.distributed.topology import Topology, build_topology
from megafab.run.fork_ranks import RankFailure, RankTimeout, run_ranks

VOCAB, HIDDEN, SEQ, MBS = 16, 16, 8, 2
TOL = 1e-10


class CountingNoSync:
    """Records how the schedule drives a data-parallel wrapper's no_sync context."""

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("enter")

    def __exit__(self, *exc):
        self.log.append("exit")


def _parity(rank, world, pp, vpp, m, layers, loss_scale):
    topo = build_topology(tp=1, pp=pp, vpp=vpp)
    weights = full_weights(VOCAB, HIDDEN, layers)
    batches = make_batches(m, SEQ, MBS, VOCAB)
    ref_losses, ref_grads = reference(weights, layers, batches)

    chunks = build_chunks(weights, layers, pp, vpp, topo.pp_rank)
    events = []

    def finalize(models):
        assert models == chunks
        events.append(("finalize", all(p.grad is not None for c in models for p in c.parameters())))

    def fresh_iterators():
        return [iter(batches) for _ in chunks] if vpp > 1 else iter(batches)

    schedule = get_forward_backward_func(pp, vpp)
    common = dict(forward_step_func=forward_step, model=chunks if vpp > 1 else chunks[0],
                  num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
                  topology=topo, dtype=torch.float64)
    logs = schedule(data_iterator=fresh_iterators(), finalize_model_grads_func=finalize,
                    no_sync_func=lambda: CountingNoSync(events),
                    grad_sync_func=lambda chunk: events.append(("grad_sync", chunks.index(chunk))),
                    loss_scale=loss_scale, **common)

    # Every gradient equals the single-process one (times the loss scale).
    worst = 0.0
    for chunk in chunks:
        for key, p in chunk.params.items():
            worst = max(worst, (p.grad - loss_scale * ref_grads[chunk.full_name(key)]).abs().max().item())
    assert worst < TOL, f"gradient differs by {worst}"
    # Grad sync: every chunk's no_sync entered at the start, left once; finalize once, at the end.
    assert events.count("enter") == events.count("exit") == len(chunks)
    assert sorted(e[1] for e in events if e[0] == "grad_sync") == list(range(len(chunks)))
    assert [e for e in events if e[0] == "finalize"] == [("finalize", True)]
    assert events[-1][0] == "finalize"

    # Evaluation: same losses, no gradient touched, finalize not called.
    grads_before = [p.grad.clone() for c in chunks for p in c.parameters()]
    eval_logs = schedule(data_iterator=fresh_iterators(), forward_only=True,
                         finalize_model_grads_func=lambda models: events.append("bad"), **common)
    assert "bad" not in events
    grads_after = [p.grad for c in chunks for p in c.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads_before, grads_after))

    if not topo.is_last_stage:
        assert logs == [] and eval_logs == []
        return None
    return [log["lm loss"].item() for log in logs], [log["lm loss"].item() for log in eval_logs], ref_losses


@pytest.mark.parametrize("pp,vpp,m,layers", [
    (2, 1, 4, 4), (2, 1, 1, 2), (4, 1, 8, 4), (4, 1, 2, 4),  # 1F1B, also m < pp (short warmup)
    (2, 2, 4, 4), (2, 2, 2, 4), (2, 2, 8, 4),               # interleaved, m == pp is all-warmup
    (4, 2, 8, 8), (4, 2, 4, 8),
])
def test_schedule_matches_single_process(pp, vpp, m, layers):
    loss_scale = 2.0 if m == 4 else 1.0
    results = run_ranks(_parity, pp, pp, vpp, m, layers, loss_scale, timeout=90)
    assert all(r is None for r in results[:-1])
    losses, eval_losses, ref_losses = results[-1]
    assert len(losses) == len(eval_losses) == m
    for got in (losses, eval_losses):
        assert max(abs(a - b) for a, b in zip(got, ref_losses)) < TOL
    assert abs(sum(losses) / m - sum(ref_losses) / m) < TOL


def test_no_pipelining_accumulates_the_mean_loss_gradient():
    layers, m = 2, 3
    weights = full_weights(VOCAB, HIDDEN, layers)
    batches = make_batches(m, SEQ, MBS, VOCAB)
    ref_losses, ref_grads = reference(weights, layers, batches)
    (chunk,) = build_chunks(weights, layers, 1, 1, 0)
    calls = []
    logs = get_forward_backward_func(1, 1)(
        forward_step_func=forward_step, data_iterator=iter(batches), model=chunk, num_microbatches=m,
        finalize_model_grads_func=calls.append)
    assert calls == [[chunk]]
    assert [log["lm loss"].item() for log in logs] == pytest.approx(ref_losses, abs=TOL)
    for key, p in chunk.params.items():
        assert (p.grad - ref_grads[chunk.full_name(key)]).abs().max().item() < TOL


def test_dispatcher_picks_megatron_schedules():
    assert get_forward_backward_func(1, 1) is forward_backward_no_pipelining
    assert get_forward_backward_func(4, 1) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(4, None) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 2) is forward_backward_pipelining_with_interleaving
    with pytest.raises(PipelineScheduleError, match="need pipeline-model-parallel-size > 1"):
        get_forward_backward_func(1, 2)


def _topology_without_groups(pp, vpp):
    return Topology(rank=0, world_size=pp, tp=1, pp=pp, dp=1, vpp=vpp, device=torch.device("cpu"),
                    backend="gloo", group_ranks={"pp": list(range(pp))})


def test_interleaving_refuses_micro_batches_not_divisible_by_pp():
    weights = full_weights(VOCAB, HIDDEN, 8)
    chunks = build_chunks(weights, 8, 4, 2, 0)
    with pytest.raises(PipelineScheduleError, match=r"num_microbatches 6 is not divisible by "
                                                    r"pipeline-model-parallel-size 4"):
        forward_backward_pipelining_with_interleaving(
            forward_step_func=forward_step, data_iterator=[iter([]), iter([])], model=chunks,
            num_microbatches=6, seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
            topology=_topology_without_groups(4, 2), dtype=torch.float64)


def test_interleaving_needs_one_iterator_per_chunk():
    chunks = build_chunks(full_weights(VOCAB, HIDDEN, 4), 4, 2, 2, 0)
    with pytest.raises(PipelineScheduleError, match="one data iterator per model chunk"):
        forward_backward_pipelining_with_interleaving(
            forward_step_func=forward_step, data_iterator=iter([]), model=chunks, num_microbatches=2,
            seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
            topology=_topology_without_groups(2, 2), dtype=torch.float64)


def test_sequence_parallel_shape_and_its_error():
    assert pipeline_tensor_shape(32, 2, 64, tp=4, sequence_parallel=True) == (8, 2, 64)
    assert pipeline_tensor_shape(32, 2, 64, tp=4, sequence_parallel=False) == (32, 2, 64)
    with pytest.raises(PipelineShapeError, match="seq_length 30 is not divisible by tensor-model-parallel"):
        pipeline_tensor_shape(30, 2, 64, tp=4, sequence_parallel=True)


def test_deallocated_output_still_backpropagates_its_gradient():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    out = x + torch.tanh(x @ w)  # [s, h], a fresh (viewless) buffer, like a stage output
    grad = torch.randn(4, 3, dtype=torch.float64)
    expected = torch.autograd.grad(out, (x, w), grad, retain_graph=True)
    deallocate_output_tensor(out)
    assert out.numel() == 1 and out.grad_fn is not None
    custom_backward(out, grad)
    assert torch.allclose(x.grad, expected[0], atol=0, rtol=0)
    assert torch.allclose(w.grad, expected[1], atol=0, rtol=0)


def _raises_mid_schedule(rank, world):
    topo = build_topology(tp=1, pp=world)
    weights = full_weights(VOCAB, HIDDEN, 4)
    (chunk,) = build_chunks(weights, 4, world, 1, topo.pp_rank)
    seen = [0]

    def failing_step(data_iterator, model):
        seen[0] += 1
        if topo.pp_rank == 1 and seen[0] == 3:
            raise RuntimeError("deliberate failure in micro-batch 3 on stage 1")
        return forward_step(data_iterator, model)

    forward_backward_pipelining_without_interleaving(
        forward_step_func=failing_step, data_iterator=iter(make_batches(8, SEQ, MBS, VOCAB)),
        model=chunk, num_microbatches=8, seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
        topology=topo, dtype=torch.float64)


def test_a_rank_failing_mid_schedule_fails_the_run_quickly():
    start = time.monotonic()
    with pytest.raises((RankFailure, RankTimeout)) as info:
        run_ranks(_raises_mid_schedule, 4, timeout=20)
    assert time.monotonic() - start < 15
    assert "deliberate failure in micro-batch 3 on stage 1" in str(info.value)


def _sent_outputs_after_schedule(rank, world, vpp, deallocate):
    topo = build_topology(tp=1, pp=world, vpp=vpp)
    chunks = build_chunks(full_weights(VOCAB, HIDDEN, 4), 4, world, vpp, topo.pp_rank)
    outputs = []

    def recording_step(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        if not model.post_process:
            outputs.append(output)
        return output, loss_func

    get_forward_backward_func(world, vpp)(
        forward_step_func=recording_step,
        data_iterator=[iter(make_batches(4, SEQ, MBS, VOCAB)) for _ in chunks],
        model=chunks, num_microbatches=4, seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
        topology=topo, dtype=torch.float64, deallocate_pipeline_outputs=deallocate)
    return [o.numel() for o in outputs]


@pytest.mark.parametrize("vpp", [1, 2])
def test_sent_activations_are_freed_only_when_asked(vpp):
    full = SEQ * MBS * HIDDEN
    freed = run_ranks(_sent_outputs_after_schedule, 2, vpp, True, timeout=60)
    kept = run_ranks(_sent_outputs_after_schedule, 2, vpp, False, timeout=60)
    # Every activation a stage sent (4 micro-batches per sending chunk) lost its storage.
    assert freed[0] == [1] * 4 * vpp and kept[0] == [full] * 4 * vpp
    assert freed[1] == [1] * 4 * (vpp - 1) and kept[1] == [full] * 4 * (vpp - 1)
