"""Loss scaling, bf16 training, non-finite detection, optimizer state and memory accounting."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megafab.distributed.data_parallel import DistributedDataParallel
from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.topology import build_topology
from megafab.optim import (
    DistributedOptimizer,
    DynamicGradScaler,
    MixedPrecisionOptimizer,
    NonFiniteGradError,
    OptimizerConfigError,
    measure_memory,
)
from megafab.run.fork_ranks import run_ranks
from tests.helpers.toy import ToyMLP, mse, regression_batch


def _fp16_overflow_skips(rank, world):
    topo = build_topology()
    model = DistributedDataParallel(ToyMLP(8, layers=1, dtype=torch.float16), dp_group=topo.group("dp"),
                                    bucket_size=20, use_distributed_optimizer=True)
    scaler = DynamicGradScaler(initial_scale=2.0 ** 10, growth_interval=2, hysteresis=2)
    opt = DistributedOptimizer([model], topology=topo, lr=1e-2, grad_scaler=scaler)
    x, y = regression_batch(4, 8, dtype=torch.float16, seed=rank)
    # Rank 1 poisons a value only it owns: rank 0 must learn of it through the all-reduce.
    victim = next(e for e in opt.entries if e.param_range[1] > e.param_range[0])
    log = []
    for inject in (False, True, True, False, False):
        opt.zero_grad()
        (mse(model, x, y) * scaler.scale).backward()
        finalize_model_grads([model], topology=topo)
        if inject and rank == 1:
            lo, _ = victim.param_range
            victim.model_param.main_grad.view(-1)[lo] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        mains = [e.main.clone() for e in opt.entries]
        ok, norm, _ = opt.step()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and all(
            torch.equal(a, e.main) for a, e in zip(mains, opt.entries))
        log.append((ok, norm is None, unchanged, scaler.scale))
    return log


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere_and_follows_hysteresis():
    for log in run_ranks(_fp16_overflow_skips, 2, timeout=120):
        assert [entry[0] for entry in log] == [True, False, False, True, True]
        assert log[1][1:3] == (True, True) and log[2][1:3] == (True, True)  # skipped: bit-identical
        assert not log[0][2] and not log[3][2]  # a real step moves the params
        # 1024 -> 1024 (clean, window 1/2) -> 1024 (hysteresis) -> 512 -> 512 (1/2) -> 1024
        assert [entry[3] for entry in log] == [1024.0, 1024.0, 512.0, 512.0, 1024.0]


def test_fp16_model_without_a_loss_scaler_is_refused():
    with pytest.raises(OptimizerConfigError, match="fp16 model needs a loss scaler"):
        MixedPrecisionOptimizer(ToyMLP(4, layers=1, dtype=torch.float16))


def _bf16_trains(rank, world):
    topo = build_topology()
    model = DistributedDataParallel(ToyMLP(16, layers=2, dtype=torch.bfloat16), dp_group=topo.group("dp"),
                                    use_distributed_optimizer=True, overlap_grad_reduce=True,
                                    bucket_size=200)
    opt = DistributedOptimizer([model], topology=topo, lr=1e-2, overlap_param_gather=True)
    x, y = regression_batch(16, 16, dtype=torch.bfloat16)
    x, y = x[rank::world], y[rank::world]
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = mse(model, x, y)
        loss.backward()
        finalize_model_grads([model], topology=topo)
        ok, _, _ = opt.step()
        assert ok
        t = loss.detach().float()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    model.finish_param_sync()
    weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    assert model.grad_buffer.dtype == torch.float32
    assert all(e.main.dtype == torch.float32 for e in opt.entries)
    return losses, weights


def test_bf16_model_trains_with_fp32_main_params_and_its_loss_falls():
    (losses, w0), (_, w1) = run_ranks(_bf16_trains, 2, timeout=120)
    print(f"bf16 loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < 0.5 * losses[0]
    assert torch.equal(w0, w1)  # the all-gather leaves every DP rank with the same weights


def test_non_finite_grad_norm_under_fp32_names_the_iteration_and_leaves_params_alone():
    model = ToyMLP(4, layers=1)
    opt = MixedPrecisionOptimizer(model, lr=0.1)
    x, y = regression_batch(4, 4)
    mse(model, x, y).backward()
    assert opt.step()[0]
    mse(model, x, y).backward()
    model.head.bias.grad.fill_(float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteGradError, match="iteration 2: the gradient norm is nan"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_weight_decay_skips_biases_and_norms_and_zeros_are_counted():
    model = ToyMLP(4, layers=1)
    opt = MixedPrecisionOptimizer(model, lr=0.1, log_num_zeros_in_grad=True, clip_grad=0.0)
    decay, plain = opt.param_groups
    assert decay["weight_decay"] == 0.01 and plain["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model.layers[0].weight), id(model.head.weight)}
    assert (decay["betas"], decay["eps"]) == ((0.9, 0.999), 1e-8)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.layers[0].weight.grad[0].zero_()
    ok, norm, zeros = opt.step()
    total = sum(p.numel() for p in model.parameters())
    assert zeros == 4 and norm == pytest.approx((total - 4) ** 0.5, abs=1e-12)


def _shards_tile_the_model(rank, world):
    topo = build_topology()
    model = DistributedDataParallel(ToyMLP(8, layers=2, dtype=torch.bfloat16), dp_group=topo.group("dp"),
                                    bucket_size=30, use_distributed_optimizer=True)
    opt = DistributedOptimizer([model], topology=topo, lr=1e-2)
    ranges = opt.param_shard_ranges()
    owned = torch.tensor(sum(hi - lo for lo, hi in ranges.values()))
    dist.all_reduce(owned)
    return owned.item() == sum(p.numel() for p in model.parameters())


def test_distributed_optimizer_shards_tile_the_model():
    """The DP ranks' shards cover every element once (resume is the checkpoint layer's, tested
    through the real saver in tests/checkpoint/)."""
    assert all(run_ranks(_shards_tile_the_model, 2, timeout=120))


def _memory(rank, world):
    topo = build_topology()
    model = DistributedDataParallel(ToyMLP(128, layers=4, dtype=torch.bfloat16), dp_group=topo.group("dp"),
                                    use_distributed_optimizer=True)
    opt = DistributedOptimizer([model], topology=topo, lr=1e-3)
    x, y = regression_batch(2 * world, 128, dtype=torch.bfloat16)
    opt.zero_grad()
    with contextlib.nullcontext():
        mse(model, x[rank::world], y[rank::world]).backward()
    finalize_model_grads([model], topology=topo)
    opt.step()
    return measure_memory([model], opt)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_distributed_optimizer_state_is_12_over_dp_bytes_per_param_for_bf16(dp):
    for report in run_ranks(_memory, dp, timeout=120):
        n = report.num_params
        per = report.per_param()
        print(f"DP={dp}: {n} params; per rank bytes/param: weights {per['weights']:.3f} "
              f"grads {per['grads']:.3f} optimizer {per['optimizer']:.3f} (model 12/{dp} = {12 / dp:.3f})")
        assert per["optimizer"] == pytest.approx(12 / dp, rel=0.05)
        assert per["weights"] == pytest.approx(2.0, rel=0.05) and per["grads"] == pytest.approx(4.0, rel=0.05)
