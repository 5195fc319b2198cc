"""DP, the distributed optimizer and the finalize step give the single-process training run."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megafab.distributed.data_parallel import DataParallelConfigError, DistributedDataParallel
from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.topology import build_topology
from megafab.optim import DistributedOptimizer, MixedPrecisionOptimizer, owned_param_ranges
from megafab.run.fork_ranks import run_ranks
from tests.helpers.toy import ToyMLP, ToyTPBlock, mse, regression_batch, shard_like

HIDDEN, GLOBAL_BATCH, MICRO_BATCHES, STEPS = 8, 8, 2, 3
LAYOUTS = [(dist_opt, overlap) for dist_opt in (False, True) for overlap in (False, True)]


def _train_reference(steps, clip):
    """Single process, whole global batch in one backward: params and grad norm after every step."""
    model = ToyMLP(HIDDEN)
    opt = MixedPrecisionOptimizer(model, lr=0.05, clip_grad=clip)
    x, y = regression_batch(GLOBAL_BATCH, HIDDEN)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        mse(model, x, y).backward()
        ok, norm, _ = opt.step()
        assert ok
        history.append(({n: p.detach().clone() for n, p in model.named_parameters()}, norm))
    return history


def _train_dp(topo, dist_opt, overlap, steps, clip):
    """This DP rank's slice of the batch in MICRO_BATCHES micro-batches, earlier ones under no_sync."""
    model = DistributedDataParallel(ToyMLP(HIDDEN), dp_group=topo.group("dp"), bucket_size=40,
                                    overlap_grad_reduce=overlap, use_distributed_optimizer=dist_opt)
    assert len(model.buckets) >= 4, "the toy model should span several buckets"
    cls = DistributedOptimizer if dist_opt else MixedPrecisionOptimizer
    opt = cls([model], topology=topo, lr=0.05, clip_grad=clip)
    x, y = regression_batch(GLOBAL_BATCH, HIDDEN)
    local = GLOBAL_BATCH // topo.dp
    mine = slice(topo.dp_rank * local, (topo.dp_rank + 1) * local)
    x, y = x[mine], y[mine]
    history = []
    for _ in range(steps):
        opt.zero_grad()
        for mb, (xm, ym) in enumerate(zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES))):
            last = mb == MICRO_BATCHES - 1
            with contextlib.nullcontext() if last else model.no_sync():
                (mse(model, xm, ym) / MICRO_BATCHES).backward()
        finalize_model_grads([model], topology=topo)
        ok, norm, _ = opt.step()
        assert ok
        history.append(({n: p.detach().clone() for n, p in model.module.named_parameters()}, norm))
    return history


def _dp_matches_one_process(rank, world):
    topo = build_topology(tp=1, pp=1)
    clip = 0.3  # below the first steps' norm, so clipping acts
    reference = _train_reference(STEPS, clip)
    assert reference[0][1] > clip
    worst = 0.0
    for dist_opt, overlap in LAYOUTS:
        history = _train_dp(topo, dist_opt, overlap, STEPS, clip)
        for (params, norm), (ref_params, ref_norm) in zip(history, reference):
            assert abs(norm - ref_norm) < 1e-10, (dist_opt, overlap, norm, ref_norm)
            for name, value in params.items():
                err = (value - ref_params[name]).abs().max().item()
                worst = max(worst, err)
                assert err < 1e-10, (dist_opt, overlap, name, err)
    return worst


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_and_distributed_optimizer_with_and_without_overlap_match_one_process(dp):
    worst = run_ranks(_dp_matches_one_process, dp, timeout=120)
    print(f"DP={dp}: worst param difference over 4 layouts x {STEPS} steps: {max(worst):.2e}")


SEQ, BATCH = 8, 4


def _train_tp_block(topo, tp_group, dist_opt, overlap, clip):
    tp = 1 if tp_group is None else topo.tp
    tp_rank = 0 if tp_group is None else topo.tp_rank
    dp = 1 if tp_group is None else topo.dp
    dp_rank = 0 if tp_group is None else topo.dp_rank
    block = ToyTPBlock(HIDDEN, tp_group=tp_group)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    y = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    # This rank's data: its DP slice of the batch, its TP slice of the sequence.
    b = BATCH // dp
    x, y = x[:, dp_rank * b:(dp_rank + 1) * b], y[:, dp_rank * b:(dp_rank + 1) * b]
    x, y = x.chunk(tp, 0)[tp_rank], y.chunk(tp, 0)[tp_rank]
    if tp_group is None:
        model, opt = block, MixedPrecisionOptimizer(block, lr=0.05, clip_grad=clip)
    else:
        model = DistributedDataParallel(block, dp_group=topo.group("dp"), bucket_size=50,
                                        overlap_grad_reduce=overlap, use_distributed_optimizer=dist_opt)
        cls = DistributedOptimizer if dist_opt else MixedPrecisionOptimizer
        opt = cls([model], topology=topo, lr=0.05, clip_grad=clip)
    history = []
    for _ in range(STEPS):
        opt.zero_grad()
        # Sum over this rank's tokens / tokens of its DP replica: the TP ranks' losses add up.
        loss = ((model(x) - y) ** 2).sum() / (SEQ * b * HIDDEN)
        loss.backward()
        if tp_group is not None:
            finalize_model_grads([model], topology=topo, sequence_parallel=True)
        ok, norm, _ = opt.step()
        assert ok
        history.append(({n: p.detach().clone() for n, p in block.named_parameters()}, norm))
    return history, block, tp, tp_rank


def _tp_sp_dp_matches_one_process(rank, world):
    topo = build_topology(tp=2, pp=1)
    assert topo.dp == 2
    clip = 0.5
    reference, _, _, _ = _train_tp_block(topo, None, False, False, clip)
    assert reference[0][1] > clip
    for dist_opt, overlap in LAYOUTS:
        history, block, tp, tp_rank = _train_tp_block(topo, topo.group("tp"), dist_opt, overlap, clip)
        for (params, norm), (ref_params, ref_norm) in zip(history, reference):
            assert abs(norm - ref_norm) < 1e-10, (dist_opt, overlap, norm, ref_norm)
            for name, value in params.items():
                expected = shard_like(ref_params[name], getattr(block, name), tp, tp_rank)
                err = (value - expected).abs().max().item()
                assert err < 1e-10, (dist_opt, overlap, name, err)
    return True


def test_tp2_sequence_parallel_dp2_matches_one_process_in_every_layout():
    assert all(run_ranks(_tp_sp_dp_matches_one_process, 4, timeout=120))


def _sp_grads_need_the_finalize_step(rank, world):
    """Without step 2 of finalize the SP-replicated grads are partial: the test above can fail."""
    topo = build_topology(tp=2, pp=1)
    block = ToyTPBlock(HIDDEN, tp_group=topo.group("tp"))
    model = DistributedDataParallel(block, dp_group=topo.group("dp"))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(SEQ // 2, BATCH, HIDDEN, dtype=torch.float64, generator=gen)
    model(x).sum().backward()
    before = block.norm_w.main_grad.clone()
    finalize_model_grads([model], topology=topo, sequence_parallel=True)
    return (block.norm_w.main_grad - before).abs().max().item()


def test_finalize_sums_sequence_parallel_grads_over_tp():
    assert min(run_ranks(_sp_grads_need_the_finalize_step, 4, timeout=60)) > 1e-3


def _tied_embedding(rank, world):
    topo = build_topology(tp=1, pp=2)
    module = torch.nn.Linear(3, 2, bias=False, dtype=torch.float64)
    module.weight.shared_embedding = True
    model = DistributedDataParallel(module, dp_group=topo.group("dp"), use_distributed_optimizer=True)
    opt = DistributedOptimizer([model], topology=topo, lr=0.1, clip_grad=0.0)
    module.weight.main_grad.fill_(1.0 + topo.pp_rank)  # stage 0 holds 1, stage 1 holds 2
    finalize_model_grads([model], topology=topo)
    grad = module.weight.main_grad.clone()
    _, norm, _ = opt.step()
    return grad.tolist(), norm


def test_tied_embedding_grads_are_summed_across_stages_and_counted_once_in_the_norm():
    results = run_ranks(_tied_embedding, 2, timeout=60)
    for grad, norm in results:
        assert grad == [[3.0] * 3] * 2
        assert abs(norm - (6 * 9.0) ** 0.5) < 1e-12  # one copy of six 3s, not two


def _shards_tile_every_param(rank, world):
    model = DistributedDataParallel(ToyMLP(HIDDEN), dp_group=dist.group.WORLD, bucket_size=30,
                                    use_distributed_optimizer=True)
    covered = {id(p): torch.zeros(p.numel(), dtype=torch.int64) for p in model.module.parameters()}
    for r in range(world):
        for p, (lo, hi) in owned_param_ranges(model, r).items():
            covered[id(p)][lo:hi] += 1
    assert all(bool((c == 1).all()) for c in covered.values())
    return [b.numel % world for b in model.buckets]


def test_distributed_optimizer_shards_cover_each_param_exactly_once():
    for rems in run_ranks(_shards_tile_every_param, 4, timeout=60):
        assert set(rems) == {0}


def _bucket_size_zero(rank, world):
    with pytest.raises(DataParallelConfigError, match="--ddp-bucket-size is 0; it must be a positive"):
        DistributedDataParallel(ToyMLP(4), dp_group=dist.group.WORLD, bucket_size=0)
    return True


def test_bucket_size_must_be_positive():
    assert run_ranks(_bucket_size_zero, 1, timeout=30) == [True]


class _Stage(torch.nn.Module):
    """One pipeline stage of the 3D toy: a tied [h, h] 'embedding' (replicated over TP, applied to
    the local sequence slice, so also sequence_parallel) and a TP/SP block."""

    def __init__(self, stage, tp_group):
        super().__init__()
        emb = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        self.emb = torch.nn.Parameter(emb * 0.4)
        self.emb.shared_embedding = self.emb.sequence_parallel = True
        self.block = ToyTPBlock(HIDDEN, tp_group=tp_group, seed=stage)
        self.stage = stage

    def forward(self, h):  # [s/tp, b, h]
        return self.block(h @ self.emb) if self.stage == 0 else self.block(h) @ self.emb.t()


def _pp_step(topo, stage, x, y, tokens):
    """One micro-batch through two stages with hand-rolled p2p (no schedule needed for one)."""
    if topo.pp_rank == 0:
        out = stage(x)
        dist.send(out.detach().contiguous(), topo.next_pp_rank)
        grad = torch.empty_like(out)
        dist.recv(grad, topo.prev_pp_rank)
        out.backward(grad)
    else:
        h = torch.empty(x.shape, dtype=x.dtype)
        dist.recv(h, topo.prev_pp_rank)
        h.requires_grad_(True)
        (((stage(h) - y) ** 2).sum() / tokens).backward()
        dist.send(h.grad.contiguous(), topo.next_pp_rank)


def _3d_matches_one_process(rank, world):
    topo = build_topology(tp=2, pp=2)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    y = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    clip = 2.0
    ref = [_Stage(0, None), _Stage(1, None)]
    ref[1].emb = ref[0].emb  # one tied tensor in the single-process model
    ref_model = torch.nn.ModuleList(ref)
    ref_opt = MixedPrecisionOptimizer(ref_model, lr=0.05, clip_grad=clip)
    reference = []
    for _ in range(STEPS):
        ref_opt.zero_grad()
        (((ref[1](ref[0](x)) - y) ** 2).sum() / (SEQ * BATCH * HIDDEN)).backward()
        _, norm, _ = ref_opt.step()
        reference.append(({n: p.detach().clone() for n, p in ref_model.named_parameters()}, norm))
    assert reference[0][1] > clip
    b = BATCH // topo.dp
    mine = (slice(None), slice(topo.dp_rank * b, (topo.dp_rank + 1) * b))
    x, y = x[mine].chunk(topo.tp, 0)[topo.tp_rank], y[mine].chunk(topo.tp, 0)[topo.tp_rank]
    for dist_opt, overlap in LAYOUTS:
        stage = _Stage(topo.pp_rank, topo.group("tp"))
        model = DistributedDataParallel(stage, dp_group=topo.group("dp"), bucket_size=60,
                                        overlap_grad_reduce=overlap, use_distributed_optimizer=dist_opt)
        cls = DistributedOptimizer if dist_opt else MixedPrecisionOptimizer
        opt = cls([model], topology=topo, lr=0.05, clip_grad=clip)
        for ref_params, ref_norm in reference:
            opt.zero_grad()
            _pp_step(topo, model, x, y, SEQ * b * HIDDEN)
            finalize_model_grads([model], topology=topo, sequence_parallel=True)
            _, norm, _ = opt.step()
            assert abs(norm - ref_norm) < 1e-10, (dist_opt, overlap, norm, ref_norm)
            for name, value in stage.named_parameters():
                # Both stages' copies of the tied weight must equal the one reference tensor.
                if name == "emb":
                    expected = ref_params["0.emb"]
                else:
                    expected = shard_like(ref_params[f"{topo.pp_rank}.{name}"],
                                          getattr(stage.block, name.split(".")[1]), topo.tp, topo.tp_rank)
                err = (value - expected).abs().max().item()
                assert err < 1e-10, (dist_opt, overlap, name, err)
    return True


def test_tp2_pp2_dp2_with_sp_tied_embedding_and_distributed_optimizer_matches_one_process():
    assert all(run_ranks(_3d_matches_one_process, 8, timeout=180))
