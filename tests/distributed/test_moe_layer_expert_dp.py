"""megafab's MoE layer under DistributedDataParallel with EP 2 on 4 ranks (DP 4, expert-DP 2): the
reduced gradients (router, shared experts over DP; routed experts over expert-DP), the grad norm
and the params after one step equal the 1-rank layer's over the whole batch (float64, 1e-10), with
plain DDP and with the overlapped distributed optimizer, for sequential and grouped experts."""

import pytest
import torch

from megafab.distributed.data_parallel import DistributedDataParallel
from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.topology import build_topology
from megafab.model.moe.settings import MoESettings
from megafab.optim import DistributedOptimizer, MixedPrecisionOptimizer
from megafab.run.fork_ranks import run_ranks
from tests.helpers.mcore_moe import HIDDEN, megafab_layer

WORLD, EP, SEQ, BATCH, CLIP = 4, 2, 4, 2, 0.05
BASE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.0,  # aux-loss grads scale per micro-batch
            moe_shared_expert_intermediate_size=40, moe_token_dispatcher_type="alltoall")


def _shard(rank):
    """DP rank `rank`'s columns of the global [s, WORLD * b, h] batch and its output gradient."""
    g = torch.Generator().manual_seed(3)
    both = torch.randn(2, SEQ, WORLD * BATCH, HIDDEN, generator=g, dtype=torch.float64)
    return tuple(t[:, rank * BATCH:(rank + 1) * BATCH].contiguous() for t in both)


def _loss(layer, x, grad):
    out, _ = layer(x)
    return (out * grad).sum()


def _reference(settings):
    """1 rank, every expert: the mean over the DP ranks' losses (each shard its own forward)."""
    layer = megafab_layer(settings, True, torch.float64)
    for shard in range(WORLD):
        (_loss(layer, *_shard(shard)) / WORLD).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    opt = MixedPrecisionOptimizer(layer, lr=0.1, clip_grad=CLIP)
    _, norm, _ = opt.step()
    return grads, norm, {n: p.detach().clone() for n, p in layer.named_parameters()}


def _reference_piece(name, value, first, grouped, ref):
    """The 1-rank layer's tensor that an EP rank's param `name` holds (its experts only)."""
    if not name.split(".")[0] == "experts":
        return ref[name]
    if grouped:
        return ref[name][first:first + value.shape[0]]
    parts = name.split(".")
    return ref[".".join([*parts[:2], str(first + int(parts[2])), *parts[3:]])]


def _layer_matches(rank, world, settings):
    topo = build_topology(ep=EP)
    ref_grads, ref_norm, ref_params = _reference(settings)
    assert ref_norm > CLIP
    worst = 0.0
    for dist_opt in (False, True):
        layer = megafab_layer(settings, True, torch.float64, ep_group=topo.group("ep"))
        first = layer.dispatcher.first_expert
        model = DistributedDataParallel(layer, dp_group=topo.group("dp", "cp"),
                                        expert_dp_group=topo.group("edp"), bucket_size=2000,
                                        overlap_grad_reduce=dist_opt, use_distributed_optimizer=dist_opt)
        assert any(b.expert for b in model.buckets) and any(not b.expert for b in model.buckets)
        cls = DistributedOptimizer if dist_opt else MixedPrecisionOptimizer
        extra = dict(overlap_param_gather=True) if dist_opt else {}
        opt = cls([model], topology=topo, lr=0.1, clip_grad=CLIP, **extra)
        opt.zero_grad()
        _loss(model, *_shard(rank)).backward()
        finalize_model_grads([model], topology=topo)
        owned = model.owned_param_ranges() if dist_opt else {}
        for name, p in layer.named_parameters():
            lo, hi = owned.get(p, (0, 0)) if dist_opt else (0, p.numel())
            ref = _reference_piece(name, p, first, settings.moe_grouped_gemm, ref_grads).reshape(-1)
            if hi > lo:
                worst = max(worst, (p.main_grad.reshape(-1)[lo:hi] - ref[lo:hi]).abs().max().item())
        ok, norm, _ = opt.step()
        assert ok and abs(norm - ref_norm) < 1e-10, (dist_opt, norm, ref_norm)
        model.finish_param_sync()
        for name, p in layer.named_parameters():
            ref = _reference_piece(name, p, first, settings.moe_grouped_gemm, ref_params)
            worst = max(worst, (p.detach() - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_layer_under_expert_data_parallel_matches_one_rank(grouped):
    settings = MoESettings(**{**BASE, "moe_grouped_gemm": grouped})
    worst = max(run_ranks(_layer_matches, WORLD, settings, timeout=120))
    assert worst < 1e-10, worst
