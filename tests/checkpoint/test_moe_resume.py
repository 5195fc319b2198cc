"""megafab's torch_dist save and resume of a MoE GPT (4 experts top-2, sigmoid scores with the
aux-loss-free expert bias, a shared expert, alltoall; float64): the checkpoint holds the routed
experts under global indices and the routers' expert_bias; a resumed run continues the
uninterrupted run's losses within 1e-10 with the distributed optimizer DP 2 -> plain DP 1 and back,
and EP 2 x DP 2 (distributed optimizer) -> EP 1 -> EP 4 x DP 4; every weight and expert bias is
restored exactly."""


import pytest
import torch

from megafab.checkpoint import checkpointing
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from tests.checkpoint.util import GLOBAL_BATCH, read_everything, train
from tests.harness import run_ranks
from tests.model.tiny import LLAMA_STYLE, tiny_config

MOE = dict(num_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05,
           moe_shared_expert_intermediate_size=24, moe_ffn_hidden_size=24,
           moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2, moe_layer_freq=(0, 1, 1, 1))


def moe_state(dp, dist_opt, ep=1, save=None, load=None, tp=1, **overrides):
    flat = dict(style=LLAMA_STYLE, dp=dp, vocab_size=101, make_vocab_size_divisible_by=8, micro_batch_size=1,
                global_batch_size=GLOBAL_BATCH, use_distributed_optimizer=dist_opt, ddp_bucket_size=700,
                lr=1e-2, train_iters=10, save=save, load=load, expert_model_parallel_size=ep, **MOE)
    cfg = tiny_config(tp=tp, sequence_parallel=tp > 1, **{**flat, **overrides})
    topo = build_topology(tp=tp, ep=ep)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker, dtype=torch.float64)
    optimizer = build_optimizer(cfg, topo, model)
    return TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))


def _snapshot(state):
    module = state.model[0].module
    return {**{k: p.detach().clone() for k, p in module.named_parameters()},
            **{k: b.clone() for k, b in module.named_buffers() if k.endswith("expert_bias")}}


def _straight(rank, world, path, ep, dist_opt):
    state = moe_state(dp=world, dist_opt=dist_opt, ep=ep, save=path)
    train(state, 3)  # an odd number of +-rate steps: every expert bias is off zero
    checkpointing.save_checkpoint(state)
    saved = _snapshot(state)
    return saved, train(state, 2)


def _resume(rank, world, src, ep, dist_opt, dst=None):
    state = moe_state(dp=world, dist_opt=dist_opt, ep=ep, load=src, save=dst)
    assert checkpointing.load_checkpoint(state) == 3
    loaded = _snapshot(state)
    if dst is not None:
        checkpointing.save_checkpoint(state)
    return loaded, train(state, 2)


def _global_expert_weights(snapshot, ep_rank: int, local: int) -> dict:
    """Sequential expert names with global indices (the ranks' snapshots merged)."""
    from megafab.checkpoint.keys import sequential_expert, sequential_expert_name

    out = {}
    for name, t in snapshot.items():
        seq = sequential_expert(name)
        out[name if seq is None else sequential_expert_name(seq[1], ep_rank * local + seq[0])] = t
    return out


def _merged(results, ep):
    out = {}
    for rank, (snap, _) in enumerate(results):
        out.update(_global_expert_weights(snap, rank % ep, 4 // ep))
    return out


def _check(expected_results, got_results, ep_a, ep_b):
    expected, got = _merged(expected_results, ep_a), _merged(got_results, ep_b)
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), k
    want, have = expected_results[0][1], got_results[0][1]
    assert max(abs(a - b) for a, b in zip(want, have)) < 1e-10, (want, have)


def test_moe_checkpoint_holds_global_experts_and_expert_bias(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_ranks(_straight, 1, path, 1, False, timeout=180)
    stored = read_everything(path + "/iter_0000003")
    assert stored["model.decoder.layers.1.mlp.experts.linear_fc1.weight"].shape == (4, 2, 24, 32)
    bias = stored["model.decoder.layers.1.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and (bias != 0).all()
    assert torch.equal(bias, results[0][0]["decoder.layers.1.mlp.router.expert_bias"])
    assert "model.decoder.layers.0.mlp.linear_fc1.weight" in stored  # the dense first layer
    fc1 = stored["model.decoder.layers.1.mlp.experts.linear_fc1.weight"].flatten(1, 2)
    for e in range(4):  # expert e is row e of the stored tensor
        name = f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"
        assert torch.equal(fc1[e], results[0][0][name])


@pytest.mark.slow  # ~20 s: three short float64 runs
def test_moe_resume_distributed_optimizer_dp2_to_plain_dp1_and_back(tmp_path):
    a, b = str(tmp_path / "dp2"), str(tmp_path / "dp1")
    expected = run_ranks(_straight, 2, a, 1, True, timeout=180)
    got_dp1 = run_ranks(_resume, 1, a, 1, False, b, timeout=180)
    _check(expected, got_dp1, 1, 1)
    got_dp2 = run_ranks(_resume, 2, b, 1, True, timeout=180)
    _check(got_dp1, got_dp2, 1, 1)


def _straight_ep(rank, world, path, ep, tp=1, **overrides):
    state = moe_state(dp=world // tp, dist_opt=True, ep=ep, save=path, tp=tp, **overrides)
    train(state, 3)
    checkpointing.save_checkpoint(state)
    return _snapshot(state), train(state, 2)


def _resume_ep(rank, world, src, ep, dst, tp=1, **overrides):
    state = moe_state(dp=world // tp, dist_opt=ep > 1, ep=ep, load=src, save=dst, tp=tp, **overrides)
    assert checkpointing.load_checkpoint(state) == 3
    loaded = _snapshot(state)
    checkpointing.save_checkpoint(state)
    return loaded, train(state, 2)



@pytest.mark.slow  # ~80 s on a loaded 2-core machine: EP 2 x DP 2, EP 1, EP 4 x DP 4 runs
def test_moe_reshards_ep2_dp2_to_ep1_to_ep4_with_the_same_weights_and_losses(tmp_path):
    a, b, c = (str(tmp_path / n) for n in ("ep2", "ep1", "ep4"))
    expected = run_ranks(_straight_ep, 2, a, 2, timeout=180)  # EP 2 (expert-DP 1), distributed optimizer
    got_ep1 = run_ranks(_resume_ep, 1, a, 1, b, timeout=180)  # EP 1, plain optimizer
    _check(expected, got_ep1, 2, 1)
    got_ep4 = run_ranks(_resume_ep, 4, b, 4, c, timeout=240)  # EP 4 x DP 4, distributed optimizer
    _check(got_ep1, got_ep4, 1, 4)


@pytest.mark.slow  # ~60 s: TP 2 (+SP) x EP 2 on 4 ranks, one rank, 4 ranks again
def test_moe_reshards_tp2_ep2_to_tp1_ep1_and_back(tmp_path):
    a, b, c = (str(tmp_path / n) for n in ("tp2ep2", "tp1ep1", "again"))
    vocab = dict(vocab_size=128)  # padded alike at TP 1 and TP 2 (the loss covers the padded rows)
    expected = run_ranks(_straight_ep, 4, a, 2, 2, timeout=240, **vocab)
    got_tp1 = run_ranks(_resume_ep, 1, a, 1, b, 1, timeout=180, **vocab)
    want, have = expected[0][1], got_tp1[0][1]
    assert max(abs(x - y) for x, y in zip(want, have)) < 1e-10, (want, have)
    got_back = run_ranks(_resume_ep, 4, b, 2, c, 2, timeout=240, **vocab)
    want, have = got_tp1[0][1], got_back[0][1]
    assert max(abs(x - y) for x, y in zip(want, have)) < 1e-10, (want, have)
