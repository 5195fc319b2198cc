"""The tensor-parallel linear core: what sequence parallel saves for backward, gradient accumulation
fusion into DDP's main_grad, and the activation memory of a whole GPT under TP + SP.
"""

import pytest
import torch
import torch.distributed as dist

from megafab.distributed.data_parallel import DistributedDataParallel
from megafab.distributed.layers import ColumnParallelLinear, RowParallelLinear
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.optim.memory import SavedActivations
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, batch, context, tiny_config

F64 = torch.float64


def _saved_shapes_under_sp(rank, world):
    topo = build_topology(tp=world)
    layer = ColumnParallelLinear(16, 8 * world, tp_group=topo.group("tp"), sequence_parallel=True,
                                 params_dtype=F64)
    x = torch.randn(4, 2, 16, dtype=F64, requires_grad=True)  # [s/tp, b, in]
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x)
    out.sum().backward()
    return shapes, tuple(out.shape)


def test_sequence_parallel_saves_the_sharded_input_not_the_gathered_one():
    shapes, out_shape = run_ranks(_saved_shapes_under_sp, 2, timeout=60)[0]
    assert out_shape == (8, 2, 8)  # the gathered sequence of 8, 8 output columns per rank
    assert (4, 2, 16) in shapes and (8, 2, 16) not in shapes


def _fusion_equals_plain_grads(rank, world, fusion, overlap):
    topo = build_topology(tp=2, pp=1)
    dp_group = topo.group("dp")
    torch.manual_seed(0)
    chunk = torch.nn.Sequential()
    chunk.add_module("col", ColumnParallelLinear(16, 32, tp_group=topo.group("tp"), params_dtype=F64,
                                                 gradient_accumulation_fusion=fusion))
    chunk.add_module("row", RowParallelLinear(32, 16, tp_group=topo.group("tp"), params_dtype=F64,
                                              gradient_accumulation_fusion=fusion))
    ddp = DistributedDataParallel(chunk, dp_group=dp_group, overlap_grad_reduce=overlap, bucket_size=200)
    x = torch.randn(8, 2, 16, dtype=F64, generator=torch.Generator().manual_seed(topo.dp_rank))
    for micro in range(2):  # accumulate over two micro-batches, reduce on the last
        ctx = ddp.no_sync() if micro == 0 else torch.enable_grad()
        with ctx:
            h, _ = ddp.module.col(x * (micro + 1))
            out, _ = ddp.module.row(torch.relu(h))
            out.pow(2).sum().backward()
    started = [b.handle is not None for b in ddp.buckets]
    grads_left = [p.grad is not None for p in chunk.parameters()]
    ddp.finish_grad_sync()
    return ([p.main_grad.clone() for p in chunk.parameters()], started, grads_left)


@pytest.mark.parametrize("overlap", [False, True])
def test_gradient_accumulation_fusion_equals_the_hook_path(overlap):
    fused = run_ranks(_fusion_equals_plain_grads, 4, True, overlap, timeout=60)
    plain = run_ranks(_fusion_equals_plain_grads, 4, False, overlap, timeout=60)
    for (f_grads, f_started, f_left), (p_grads, _, _) in zip(fused, plain):
        for a, b in zip(f_grads, p_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        assert not any(f_left)  # no .grad was ever left behind
        if overlap:  # the post-accumulate hook still drove every bucket's collective in backward
            assert all(f_started)


DIMS = dict(num_layers=2, hidden_size=128, num_attention_heads=8, seq_length=32, vocab_size=512,
            make_vocab_size_divisible_by=128, hidden_dropout=0.1, attention_dropout=0.1)


def _saved_bytes_of_a_gpt(rank, world, style):
    dims = dict(DIMS, num_query_groups=4) if style is LLAMA_STYLE else DIMS
    cfg = tiny_config(tp=world, style=style, **dims).model
    group = dist.new_group(list(range(world))) if world > 1 else None
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, rank, 0, "cpu", tracker)
    model = GPTModel(cfg, context(tp_group=group, sequence_parallel=world > 1, tracker=tracker,
                                  dtype=torch.float32))
    tokens, labels, mask = batch(cfg, micro_batch=2)
    with SavedActivations(model.parameters()) as saved:  # embedding, layers, output layer, loss
        loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    return saved.bytes


@pytest.mark.parametrize("style", [GPT2_STYLE, LLAMA_STYLE], ids=["gpt2", "llama"])
def test_tensor_and_sequence_parallel_shard_every_saved_activation(style):
    """Korthikanti et al. 2022: with TP + SP each rank saves 1/t of the activations."""
    single = run_ranks(_saved_bytes_of_a_gpt, 1, style, timeout=60)[0]
    for tp in (2, 4):
        per_rank = run_ranks(_saved_bytes_of_a_gpt, tp, style, timeout=60)
        ratio = max(per_rank) / (single / tp)
        assert ratio <= 1.10, f"TP {tp} + SP saves {ratio:.3f}x of (TP 1 bytes)/{tp}"


def _fusion_under_saved_tensor_hooks(rank, world):
    layer = ColumnParallelLinear(8, 4, tp_group=None, params_dtype=F64)
    ddp = DistributedDataParallel(layer, dp_group=dist.group.WORLD)
    x = torch.randn(3, 2, 8, dtype=F64)
    with SavedActivations(layer.parameters()):  # unpacked saved tensors are not the Parameter objects
        out, _ = layer(x)
    out.sum().backward()
    expected = torch.ones(3 * 2, 4, dtype=F64).t() @ x.reshape(-1, 8)
    return torch.equal(ddp.module.weight.main_grad, expected) and layer.weight.grad is None


def test_fusion_survives_saved_tensor_hooks():
    assert run_ranks(_fusion_under_saved_tensor_hooks, 1, timeout=60) == [True]
