"""FullyShardedDataParallel (FSDP2 over the DP group, gloo on CPU): dim-0 shards that tile every
parameter (uneven rows: the last rank holds fewer), Megatron attributes carried to the DTensors,
gradient accumulation without communication (one reduce-scatter per FSDP group per step, whatever
the number of micro-batches), and the linear core's weight gradients through autograd."""

import torch
import torch.distributed as dist
from torch import nn

from megafab.distributed.fsdp import FullyShardedDataParallel, data_parallel_mesh, local_tensor
from megafab.distributed.topology import build_topology
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import train_step
from tests.helpers.driver import driver_state
from tests.helpers.tiny import batch, tiny_config


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 5, dtype=torch.float64)  # weight [5, 3]: rows 3 + 2 over DP 2
        self.outer = nn.Linear(5, 1, dtype=torch.float64)
        self.inner.weight.tensor_model_parallel = True
        self.inner.weight.partition_dim = 0

    def forward(self, x):
        return self.outer(self.inner(x))


def _shards(rank, world):
    topo = build_topology()
    torch.manual_seed(0)
    toy = _Toy()
    full = {n: p.detach().clone() for n, p in toy.named_parameters()}
    wrapped = FullyShardedDataParallel(toy, mesh=data_parallel_mesh(topo), units=[toy.inner])
    weight = wrapped.module.inner.weight
    assert weight.tensor_model_parallel and weight.partition_dim == 0  # attributes carried over
    out = {}
    for name, p in wrapped.module.named_parameters():
        lo, hi = wrapped.owned_param_ranges().get(p, (0, 0))
        local = local_tensor(p).reshape(-1)
        assert torch.equal(local, full[name].reshape(-1)[lo:hi]), name  # the rows it owns, as values
        out[name] = (lo, hi, tuple(p.shape))
    return out


def test_shards_are_dim0_row_ranges_that_tile_each_parameter():
    ranks = run_ranks(_shards, 2, timeout=60)
    assert ranks[0]["inner.weight"] == (0, 9, (5, 3)) and ranks[1]["inner.weight"] == (9, 15, (5, 3))
    for name, (_, _, shape) in ranks[0].items():
        numel = torch.Size(shape).numel()
        covered = sorted((r[name][0], r[name][1]) for r in ranks if r[name][1] > r[name][0])
        assert covered[0][0] == 0 and covered[-1][1] == numel, (name, covered)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), (name, covered)


def _reduce_scatters_per_step(rank, world, micro_batches):
    cfg = tiny_config(dp=world, micro_batch_size=1, global_batch_size=micro_batches * world,
                      use_torch_fsdp2=True, lr=1e-3)
    state = driver_state(cfg, torch.float64)
    assert not any(hasattr(p, "main_grad") for p in state.model[0].parameters())  # no fusion buffer
    calls = []
    original = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    data = []
    for k in range(micro_batches):
        tokens, labels, mask = batch(cfg.model, micro_batch=1, seed=10 * rank + k)
        data.append({"tokens": tokens, "labels": labels, "loss_mask": mask})
    dist.reduce_scatter_single = counting
    try:
        metrics = train_step(state, iter(data))
    finally:
        dist.reduce_scatter_single = original
    assert metrics["update_ok"] and metrics["grad_norm"] > 0
    # one group per attention block, MLP and layer (its norms) of each layer, and the root
    return len(calls), 3 * cfg.model.num_layers + 1


def test_gradient_accumulation_reduces_once_per_group_per_step():
    for micro_batches in (1, 4):
        for calls, groups in run_ranks(_reduce_scatters_per_step, 2, micro_batches, timeout=120):
            assert calls == groups, (micro_batches, calls, groups)


def test_layer_units_are_attention_mlp_then_the_layer_and_skip_plain_containers():
    from megafab.distributed.fsdp import layer_units

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            return self.linear(x)

    class Layer(nn.Module):
        def __init__(self, container: bool):
            super().__init__()
            self.input_layernorm = nn.LayerNorm(2)  # a norm stays with the layer's own unit
            self.self_attention = nn.Module() if container else Block()  # TE: a plain holder
            if container:
                self.self_attention.linear = nn.Linear(2, 2)
            self.mlp = Block()

        def forward(self, x):
            return x

    plain, te_like = Layer(container=False), Layer(container=True)
    assert layer_units([plain, te_like]) == [plain.self_attention, plain.mlp, plain, te_like.mlp, te_like]
