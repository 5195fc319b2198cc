"""Expert params (`is_expert`) reduce over expert-DP, dense params over DP: with EP 2 x DP 4 on 4
ranks (expert-DP 2) and EP 4 (expert-DP 1), the reduced gradients, the grad norm and the params
after each step equal the one-process model's (every expert local) for plain and overlapped DDP,
the distributed optimizer (with overlapped param gather), FSDP2 and CPU offload; a NaN in one
expert's gradient on one rank stops the step on every rank."""

import contextlib

import pytest
import torch

from megafab.distributed.data_parallel import DistributedDataParallel
from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.fsdp import (
    FullyShardedDataParallel,
    data_parallel_mesh,
    expert_data_parallel_mesh,
    local_tensor,
    shard_range,
)
from megafab.distributed.topology import build_topology
from megafab.optim import DistributedOptimizer, MixedPrecisionOptimizer
from megafab.optim.cpu_offload import OffloadConfig
from megafab.optim.fully_sharded_optimizer import FullyShardedOptimizer
from megafab.optim.grad_scaler import ConstantGradScaler
from megafab.run.fork_ranks import run_ranks
from tests.helpers.toy_expert import ToyMoE

HIDDEN, EXPERTS, GLOBAL_BATCH, MICRO_BATCHES, STEPS, CLIP = 6, 4, 16, 2, 2, 0.3
# (name, wrapper, distributed optimizer, overlap grad reduce, overlap param gather, offload)
LAYOUTS = [("ddp", "ddp", False, False, False, False), ("ddp-overlap", "ddp", False, True, False, False),
           ("distopt", "ddp", True, False, False, False),
           ("distopt-overlap", "ddp", True, True, True, False),
           ("distopt-offload", "ddp", True, False, False, True),
           ("fsdp", "fsdp", False, False, False, False), ("fsdp-offload", "fsdp", False, False, False, True)]


def _batch():
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(GLOBAL_BATCH, HIDDEN, generator=gen, dtype=torch.float64),
            torch.randn(GLOBAL_BATCH, generator=gen, dtype=torch.float64))


def _mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _reference():
    """One process, every expert local, the whole batch: per step (grads, norm, params)."""
    model = ToyMoE(HIDDEN, EXPERTS)
    opt = MixedPrecisionOptimizer(model, lr=0.05, clip_grad=CLIP)
    x, y = _batch()
    history = []
    for _ in range(STEPS):
        opt.zero_grad()
        _mse(model, x, y).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        ok, norm, _ = opt.step()
        assert ok
        history.append((grads, norm, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return history


def _wrap(topo, layout):
    _, wrapper, dist_opt, overlap, overlap_gather, offload = layout
    toy = ToyMoE(HIDDEN, EXPERTS, ep_group=topo.group("ep"))
    kwargs = dict(topology=topo, lr=0.05, clip_grad=CLIP)
    if offload:
        kwargs["cpu_offload"] = OffloadConfig(fraction=0.6)
    if wrapper == "fsdp":
        model = FullyShardedDataParallel(toy, mesh=data_parallel_mesh(topo), units=[],
                                         expert_mesh=expert_data_parallel_mesh(topo))
        return toy, model, FullyShardedOptimizer([model], **kwargs)
    model = DistributedDataParallel(toy, dp_group=topo.group("dp", "cp"), expert_dp_group=topo.group("edp"),
                                    bucket_size=60, overlap_grad_reduce=overlap,
                                    use_distributed_optimizer=dist_opt)
    experts = [b for b in model.buckets if b.expert]
    assert experts and len(experts) < len(model.buckets), "dense and expert buckets both"
    assert all(b.group is topo.group("edp") and b.dp == topo.size("edp") for b in experts)
    if dist_opt:
        return toy, model, DistributedOptimizer([model], overlap_param_gather=overlap_gather, **kwargs)
    return toy, model, MixedPrecisionOptimizer([model], **kwargs)


def _pieces(toy, model, values) -> dict:
    """{reference name: (lo, hi, flat values)} of what this rank holds reduced: the whole tensor
    under plain DDP, its owned shard under the distributed optimizer and FSDP2."""
    sharded = getattr(model, "use_distributed_optimizer", False)
    owned = model.owned_param_ranges() if sharded else {}
    out = {}
    for name, p in toy.named_parameters():
        if getattr(model, "is_fully_sharded", False):
            lo, hi = shard_range(p)
            t = values(p)
            flat = local_tensor(t).reshape(-1) if t is not None else None
        else:
            lo, hi = owned.get(p, (0, 0)) if sharded else (0, p.numel())
            t = values(p)
            flat = t.reshape(-1)[lo:hi]
        if hi > lo and flat is not None:
            out[toy.global_expert_name(name)] = (lo, hi, flat.detach().clone())
    return out


def _train(topo, layout):
    toy, model, opt = _wrap(topo, layout)
    x, y = _batch()
    mine = slice(topo.dp_rank * GLOBAL_BATCH // topo.dp, (topo.dp_rank + 1) * GLOBAL_BATCH // topo.dp)
    x, y = x[mine], y[mine]
    grad_of = (lambda p: p.grad) if layout[1] == "fsdp" else (lambda p: p.main_grad)
    history = []
    for _ in range(STEPS):
        opt.zero_grad()
        for mb, (xm, ym) in enumerate(zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES))):
            with contextlib.nullcontext() if mb == MICRO_BATCHES - 1 else model.no_sync():
                (_mse(model, xm, ym) / MICRO_BATCHES).backward()
        finalize_model_grads([model], topology=topo)
        grads = _pieces(toy, model, grad_of)
        ok, norm, _ = opt.step()
        assert ok
        if layout[4]:  # overlapped param gather: the next forward would gather; gather now to compare
            model.finish_param_sync()
        params = _pieces(toy, model, lambda p: p) if layout[1] == "fsdp" else \
            {toy.global_expert_name(n): (0, p.numel(), p.detach().reshape(-1).clone())
             for n, p in toy.named_parameters()}
        history.append((grads, norm, params))
    return history


def _close(pieces, reference, what):
    worst = 0.0
    for name, (lo, hi, value) in pieces.items():
        err = (value - reference[name].reshape(-1)[lo:hi]).abs().max().item()
        assert err < 1e-10, (what, name, err)
        worst = max(worst, err)
    return worst


def _expert_layouts_match_one_process(rank, world, ep):
    topo = build_topology(ep=ep)
    assert topo.size("edp") == world // ep and topo.dp == world
    reference = _reference()
    assert reference[0][1] > CLIP  # clipping acts
    worst, held = 0.0, {}
    for layout in LAYOUTS:
        for step, ((grads, norm, params), (ref_grads, ref_norm, ref_params)) in enumerate(
                zip(_train(topo, layout), reference)):
            assert abs(norm - ref_norm) < 1e-10, (layout[0], step, norm, ref_norm)
            worst = max(worst, _close(grads, ref_grads, (layout[0], step, "grad")),
                        _close(params, ref_params, (layout[0], step, "param")))
            if step == 0:
                held[layout[0]] = sorted(grads)
    return worst, held


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_grads_reduce_over_expert_dp_and_match_one_process(ep):
    results = run_ranks(_expert_layouts_match_one_process, 4, ep, timeout=180)
    experts_per_rank = EXPERTS // ep
    for rank, (_, held) in enumerate(results):
        # Each rank holds (and reduces) only its own EP rank's experts.
        mine = {n.split(".")[1] for n in held["ddp"] if n.startswith("experts.")}
        first = (rank % ep) * experts_per_rank
        assert mine == {str(e) for e in range(first, first + experts_per_rank)}, (rank, mine)
    print(f"EP={ep}: worst difference over {len(LAYOUTS)} layouts x {STEPS} steps: "
          f"{max(w for w, _ in results):.2e}")


def _nan_in_one_expert_stops_every_rank(rank, world):
    topo = build_topology(ep=2)
    x, y = _batch()
    local = GLOBAL_BATCH // topo.dp
    x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    outcomes = {}
    for dist_opt in (False, True):
        for scaler in (None, ConstantGradScaler(1.0)):
            toy = ToyMoE(HIDDEN, EXPERTS, ep_group=topo.group("ep"))
            model = DistributedDataParallel(toy, dp_group=topo.group("dp", "cp"),
                                            expert_dp_group=topo.group("edp"),
                                            use_distributed_optimizer=dist_opt)
            cls = DistributedOptimizer if dist_opt else MixedPrecisionOptimizer
            opt = cls([model], topology=topo, lr=0.05, grad_scaler=scaler, raise_on_non_finite=False)
            before = {n: p.detach().clone() for n, p in toy.named_parameters()}
            opt.zero_grad()
            _mse(model, x, y).backward()
            if rank == 0:  # one element of one expert's gradient, on one rank
                toy.experts[0][0].weight.main_grad[0, 0] = float("nan")
            finalize_model_grads([model], topology=topo)
            ok, norm, _ = opt.step()
            unchanged = all(torch.equal(p, before[n]) for n, p in toy.named_parameters())
            outcomes[(dist_opt, scaler is not None)] = (ok, norm is None or norm != norm, unchanged)
    return outcomes


def test_nan_in_one_expert_grad_is_found_on_every_rank():
    for outcomes in run_ranks(_nan_in_one_expert_stops_every_rank, 4, timeout=120):
        assert len(outcomes) == 4
        for key, (ok, norm_not_finite, unchanged) in outcomes.items():
            assert not ok and norm_not_finite and unchanged, key
