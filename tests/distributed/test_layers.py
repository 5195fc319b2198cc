"""Tensor-parallel layers equal nn.Linear / nn.Embedding on the gathered tensors (float64, gloo).

The single-process reference is built inside each rank from the same init_method seed, so the
test also proves the sharded initialization: no weight is copied into the parallel layers.
Biases start at zero; both sides get the same nonzero bias so that bias gradients are tested.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megafab.distributed.layers import (
    ColumnParallelLinear,
    ParallelLayerError,
    RowParallelLinear,
    VocabParallelEmbedding,
    join_partitions,
    partition_of,
    vocab_range,
)
from megafab.distributed.topology import build_topology
from megafab.run.fork_ranks import run_ranks

F64 = torch.float64
S, B = 8, 2  # sequence and micro-batch, [s, b, h]


def seeded_init(seed):
    def init(tensor):
        nn.init.normal_(tensor, 0.0, 0.02, generator=torch.Generator().manual_seed(seed))
    return init


def rand(seed, *shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-10)


def all_gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def reference_linear(in_size, out_size, seed):
    ref = nn.Linear(in_size, out_size, dtype=F64)
    with torch.no_grad():
        seeded_init(seed)(ref.weight)
        ref.bias.copy_(rand(seed + 1, out_size))
    return ref


def _check_column(topo, sp, stride, gather_output):
    group, r, tp = topo.group("tp"), topo.tp_rank, topo.tp
    in_size, out_size, seed = 16, 24, 11
    layer = ColumnParallelLinear(in_size, out_size, tp_group=group, sequence_parallel=sp, stride=stride,
                                 gather_output=gather_output, init_method=seeded_init(seed),
                                 params_dtype=F64)
    ref = reference_linear(in_size, out_size, seed)
    assert layer.weight.shape == (out_size // tp, in_size)
    close(layer.weight.detach(), partition_of(ref.weight.detach(), 0, r, tp, stride))
    with torch.no_grad():
        layer.bias.copy_(partition_of(ref.bias, 0, r, tp, stride))

    x_full, g_full = rand(1, S, B, in_size), rand(2, S, B, out_size)
    x_ref = x_full.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    (y_ref * g_full).sum().backward()

    x = (x_full.chunk(tp, 0)[r] if sp else x_full).clone().requires_grad_(True)
    y, bias_out = layer(x)
    assert bias_out is None
    if gather_output:
        close(y, y_ref)
        g = g_full
    else:
        close(y, partition_of(y_ref.detach(), 2, r, tp, stride))
        g = partition_of(g_full, 2, r, tp, stride)
    (y * g).sum().backward()
    close(x.grad, x_ref.grad.chunk(tp, 0)[r] if sp else x_ref.grad)
    close(layer.weight.grad, partition_of(ref.weight.grad, 0, r, tp, stride))
    close(layer.bias.grad, partition_of(ref.bias.grad, 0, r, tp, stride))
    # the gathered shards rebuild the single-process weight
    close(join_partitions(all_gather(layer.weight.detach(), group), 0, stride), ref.weight.detach())
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
    assert layer.weight.partition_stride == stride and layer.bias.tensor_model_parallel


def _check_row(topo, sp, input_is_parallel):
    group, r, tp = topo.group("tp"), topo.tp_rank, topo.tp
    in_size, out_size, seed = 24, 16, 21
    layer = RowParallelLinear(in_size, out_size, tp_group=group, sequence_parallel=sp,
                              input_is_parallel=input_is_parallel, init_method=seeded_init(seed),
                              params_dtype=F64)
    ref = reference_linear(in_size, out_size, seed)
    assert layer.weight.shape == (out_size, in_size // tp)
    close(layer.weight.detach(), partition_of(ref.weight.detach(), 1, r, tp))
    with torch.no_grad():
        layer.bias.copy_(ref.bias)

    x_full, g_full = rand(3, S, B, in_size), rand(4, S, B, out_size)
    x_ref = x_full.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    (y_ref * g_full).sum().backward()

    x = (x_full.chunk(tp, 2)[r] if input_is_parallel else x_full).clone().requires_grad_(True)
    y, bias_out = layer(x)
    assert bias_out is None
    g = g_full.chunk(tp, 0)[r] if sp else g_full
    close(y, y_ref.detach().chunk(tp, 0)[r] if sp else y_ref)
    (y * g).sum().backward()
    close(x.grad, x_ref.grad.chunk(tp, 2)[r] if input_is_parallel else x_ref.grad)
    close(layer.weight.grad, partition_of(ref.weight.grad, 1, r, tp))
    bias_grad = layer.bias.grad.clone()
    if sp:  # each rank saw its sequence chunk only: finalize_grads all-reduces these over TP
        assert layer.bias.sequence_parallel
        dist.all_reduce(bias_grad, group=group)
    close(bias_grad, ref.bias.grad)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 1
    assert not getattr(layer.bias, "tensor_model_parallel", False)
    assert layer.bias.sequence_parallel == sp


def _check_skip_bias_add(topo):
    group = topo.group("tp")
    col = ColumnParallelLinear(16, 24, tp_group=group, skip_bias_add=True, params_dtype=F64)
    row = RowParallelLinear(24, 16, tp_group=group, skip_bias_add=True, params_dtype=F64)
    x = rand(5, S, B, 16)
    y, bias = col(x)
    assert bias is col.bias
    close(y, x @ col.weight.detach().T)
    z, bias = row(y)
    assert bias is row.bias
    w_full = join_partitions(all_gather(row.weight.detach(), group), 1)
    y_full = join_partitions(all_gather(y.detach(), group), 2)
    close(z, y_full @ w_full.T)


def _check_embedding(topo, real_vocab):
    group, r, tp = topo.group("tp"), topo.tp_rank, topo.tp
    padded = -(-real_vocab // tp) * tp  # the model pads the vocabulary to a multiple of TP
    hidden, seed = 8, 31
    if padded != real_vocab:
        with pytest.raises(ParallelLayerError, match="not divisible by tensor-model-parallel size"):
            VocabParallelEmbedding(real_vocab, hidden, tp_group=group, params_dtype=F64)
    emb = VocabParallelEmbedding(padded, hidden, tp_group=group, init_method=seeded_init(seed),
                                 params_dtype=F64)
    ref = nn.Embedding(padded, hidden, dtype=F64)
    with torch.no_grad():
        seeded_init(seed)(ref.weight)
    lo, hi = vocab_range(padded, r, tp)
    assert (emb.vocab_start, emb.vocab_end) == (lo, hi) and emb.weight.shape == (hi - lo, hidden)
    close(emb.weight.detach(), ref.weight.detach()[lo:hi])

    ids = torch.randint(0, real_vocab, (B, S), generator=torch.Generator().manual_seed(6))
    g = rand(7, B, S, hidden)
    y = emb(ids)
    y_ref = ref(ids)
    close(y, y_ref)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    close(emb.weight.grad, ref.weight.grad[lo:hi])
    assert emb.weight.tensor_model_parallel and emb.weight.partition_dim == 0


def _check_layers(rank, world, tp):
    topo = build_topology(tp=tp)
    for sp in (False, True):
        _check_column(topo, sp, stride=1, gather_output=False)
        _check_column(topo, sp, stride=2, gather_output=False)
        _check_row(topo, sp, input_is_parallel=True)
    _check_column(topo, False, stride=1, gather_output=True)
    _check_row(topo, False, input_is_parallel=False)
    _check_skip_bias_add(topo)
    _check_embedding(topo, real_vocab=13)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_equal_single_process(tp):
    # world 4 with tp=2 runs two TP groups side by side (DP=2)
    assert run_ranks(_check_layers, 4, tp, timeout=120) == [True] * 4


def _check_stride_two_holds_gate_and_up(rank, world):
    topo = build_topology(tp=world)
    ffn = 8
    fc1 = ColumnParallelLinear(6, 2 * ffn, tp_group=topo.group("tp"), stride=2, bias=False,
                               init_method=seeded_init(5), params_dtype=F64)
    full = torch.empty(2 * ffn, 6, dtype=F64)
    seeded_init(5)(full)
    gate, up = full[:ffn], full[ffn:]
    per = ffn // world
    expected = torch.cat([gate[rank * per:(rank + 1) * per], up[rank * per:(rank + 1) * per]])
    close(fc1.weight.detach(), expected)
    return True


def test_stride_two_rank_holds_its_gate_then_its_up_rows():
    assert run_ranks(_check_stride_two_holds_gate_and_up, 4, timeout=60) == [True] * 4


def _check_default_init_is_sharded_single_process_init(rank, world):
    topo = build_topology(tp=world)
    torch.manual_seed(1234)  # same default stream on every TP rank, as model_parallel_seed sets it
    col = ColumnParallelLinear(8, 16, tp_group=topo.group("tp"))
    torch.manual_seed(1234)
    single = ColumnParallelLinear(8, 16, tp_group=None)
    assert col.weight.dtype == torch.float32
    assert torch.equal(col.weight.detach(), partition_of(single.weight.detach(), 0, rank, world))
    assert 0.01 < single.weight.std().item() < 0.03  # normal(0, 0.02)
    assert torch.count_nonzero(col.bias) == 0
    return True


def test_default_init_is_normal_002_sharded_from_the_tp1_weight():
    assert run_ranks(_check_default_init_is_sharded_single_process_init, 2, timeout=60) == [True] * 2


def test_one_process_layers_are_plain_torch_layers():
    col = ColumnParallelLinear(4, 6, tp_group=None, init_method=seeded_init(1), params_dtype=torch.bfloat16)
    master = torch.empty(6, 4)
    seeded_init(1)(master)
    assert col.weight.dtype == torch.bfloat16
    assert torch.equal(col.weight.detach(), master.to(torch.bfloat16))  # float32 master, then cast
    x = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    assert torch.equal(col(x)[0], nn.functional.linear(x, col.weight, col.bias))


def test_bad_sizes_are_user_errors_with_the_fix():
    with pytest.raises(ParallelLayerError, match="vocabulary size 13 is not divisible by .* 2"):
        vocab_range(13, 0, 2)
    with pytest.raises(ParallelLayerError, match="gather_output=True with sequence_parallel=True"):
        ColumnParallelLinear(4, 4, tp_group=None, gather_output=True, sequence_parallel=True)
    with pytest.raises(ParallelLayerError, match="input_is_parallel=False"):
        RowParallelLinear(4, 4, tp_group=None, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ParallelLayerError, match="output size is 6, .* stride 4 = 4"):
        ColumnParallelLinear(4, 6, tp_group=None, stride=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on GPU machines)")
def test_layers_on_cuda_hold_the_cpu_weights_and_compute_the_same():
    cuda = torch.device("cuda")
    for make in (lambda dev: ColumnParallelLinear(16, 24, tp_group=None, init_method=seeded_init(1),
                                                  params_dtype=F64, device=dev),
                 lambda dev: RowParallelLinear(16, 24, tp_group=None, init_method=seeded_init(1),
                                               params_dtype=F64, device=dev)):
        on_gpu, on_cpu = make(cuda), make(None)
        assert on_gpu.weight.device.type == "cuda" and on_gpu.bias.device.type == "cuda"
        assert torch.equal(on_gpu.weight.detach().cpu(), on_cpu.weight.detach())
        x = rand(1, S, B, 16)
        close(on_gpu(x.to(cuda))[0].cpu(), on_cpu(x)[0])
    emb = VocabParallelEmbedding(16, 8, tp_group=None, init_method=seeded_init(2), params_dtype=F64,
                                 device=cuda)
    ids = torch.randint(0, 16, (B, S))
    ref = torch.empty(16, 8, dtype=F64)
    seeded_init(2)(ref)
    close(emb(ids.to(cuda)).cpu(), ref[ids])
