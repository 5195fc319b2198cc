"""megafab's torch_dist save and resume of a MoE GPT (4 experts top-2, sigmoid scores with the
aux-loss-free expert bias, a shared expert, alltoall; float64): the checkpoint holds the routed
experts under global indices and the routers' expert_bias; a resumed run continues the
uninterrupted run's losses within 1e-10 with the distributed optimizer DP 2 -> plain DP 1 and back.

Chains of runs, each resuming the last one's checkpoint and training on, against one process
that never stopped (every step's loss within 1e-10, every checkpoint's tensors -- the experts'
Adam moments included -- the same, the weights and expert biases restored exactly):
EP 2 x expert-DP 2 (distributed optimizer) -> EP 4 (distributed optimizer) -> EP 1 on one rank;
FSDP2 with EP 2 -> EP 1 x DP 2 distributed optimizer -> FSDP2 with EP 2; TP 2 (+SP) x EP 2 ->
TP 1 x EP 1 -> TP 2 x EP 2."""


import pytest
import torch

from megafab.checkpoint import checkpointing
from megafab.distributed.fsdp import is_dtensor
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import moe_state, read_everything, train


def _whole(p):
    return p.full_tensor() if is_dtensor(p) else p


def _snapshot(state):
    """Every parameter (an FSDP2 shard gathered whole) and expert bias of this rank's model."""
    module = state.model[0].module
    return {**{k: _whole(p.detach()).clone() for k, p in module.named_parameters()},
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
    from megafab.param_names import sequential_expert, sequential_expert_name

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


@pytest.mark.slow  # ~10 s: three short float64 runs
def test_moe_resume_distributed_optimizer_dp2_to_plain_dp1_and_back(tmp_path):
    a, b = str(tmp_path / "dp2"), str(tmp_path / "dp1")
    expected = run_ranks(_straight, 2, a, 1, True, timeout=180)
    got_dp1 = run_ranks(_resume, 1, a, 1, False, b, timeout=180)
    _check(expected, got_dp1, 1, 1)
    got_dp2 = run_ranks(_resume, 2, b, 1, True, timeout=180)
    _check(got_dp1, got_dp2, 1, 1)


# The chains: every leg loads the last one's checkpoint, trains 2 steps and saves; the vocabulary is
# padded alike at TP 1 and TP 2 (the loss covers the padded rows).
CHAIN = dict(vocab_size=128)


def _uninterrupted(rank, world, path):
    """The reference: one process, EP 1, plain Adam, 6 steps, saving after steps 2, 4 and 6."""
    state = moe_state(dp=1, dist_opt=False, save=path, **CHAIN)
    losses = []
    for _ in range(3):
        losses += train(state, 2)
        checkpointing.save_checkpoint(state)
    return losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe_ref") / "ckpt")
    return path, run_ranks(_uninterrupted, 1, path, timeout=180)[0]


def _leg(rank, world, src, dst, ep, tp=1, **layout):
    """Load `src` (None: start fresh), train 2 steps, save to `dst`: (iteration loaded, weights
    as loaded, losses, weights as saved); the weights only at TP 1 (_merged knows no TP blocks)."""
    state = moe_state(dp=world // tp, ep=ep, tp=tp, load=src, save=dst, **{"dist_opt": False, **layout},
                      **CHAIN)
    start = 0 if src is None else checkpointing.load_checkpoint(state)
    loaded = _snapshot(state) if src is not None and tp == 1 else None
    losses = train(state, 2)
    checkpointing.save_checkpoint(state)
    return start, loaded, losses, _snapshot(state) if tp == 1 else None


def _assert_same_checkpoint(a, b):
    """Every stored tensor (weights, expert biases, Adam moments of the global experts) alike."""
    a, b = read_everything(a), read_everything(b)
    common = a.keys() & b.keys()  # a distributed optimizer's also holds main_param copies
    assert all(k.endswith(".main_param") for k in a.keys() ^ b.keys()), a.keys() ^ b.keys()
    assert any(".experts." in k and k.endswith(".exp_avg_sq") for k in common)
    for k in common:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.allclose(a[k], b[k], rtol=1e-10, atol=1e-13), k


def _run_chain(legs, uninterrupted, tmp_path) -> list[float]:
    """Run `legs` [(world, ep, tp, layout)] one after another from a fresh start, each loading the
    previous one's checkpoint. Every leg starts at the step the last one stopped, with exactly the
    weights and expert biases it saved (TP 1 legs); every step's loss is the uninterrupted run's
    within 1e-10 and every checkpoint holds its tensors (optimizer state included). Returns each
    leg's max |loss - uninterrupted loss|."""
    ref_path, ref = uninterrupted
    src, saved, diffs = None, None, []
    for i, (world, ep, tp, layout) in enumerate(legs):
        dst = str(tmp_path / f"leg{i}")
        results = run_ranks(_leg, world, src, dst, ep, tp, timeout=240, **layout)
        assert [r[0] for r in results] == [2 * i] * world
        if saved is not None and tp == 1:
            loaded = _merged([(r[1], None) for r in results], ep)
            assert loaded.keys() == saved.keys()
            for k in loaded:
                assert torch.equal(loaded[k], saved[k]), (i, k)
        losses, want = results[0][2], ref[2 * i: 2 * i + 2]
        assert len(losses) == 2 and all(r[2] == losses for r in results)
        diffs.append(max(abs(a - b) for a, b in zip(losses, want)))
        assert diffs[-1] < 1e-10, (i, losses, want)
        it = f"/iter_{2 * i + 2:07d}"
        _assert_same_checkpoint(dst + it, ref_path + it)
        saved = _merged([(r[3], None) for r in results], ep) if tp == 1 else None
        src = dst
    return diffs


DIST_OPT = dict(dist_opt=True)


@pytest.mark.slow  # ~15 s (+7 s reference): EP 2 x expert-DP 2, EP 4 on 4 ranks (dist-opt), one rank
def test_moe_resume_ep2_edp2_to_ep4_to_ep1_continues_the_uninterrupted_losses(uninterrupted, tmp_path):
    diffs = _run_chain([(4, 2, 1, DIST_OPT), (4, 4, 1, DIST_OPT), (1, 1, 1, {})], uninterrupted, tmp_path)
    print("max |loss - uninterrupted| per leg (EP 2 x EDP 2, EP 4, EP 1):", diffs)


@pytest.mark.slow  # ~17 s: FSDP2 with EP 2 on 4 ranks, EP 1 distributed optimizer on 2, FSDP2 again
def test_moe_resume_fsdp2_ep2_to_ep1_distributed_optimizer_and_back(uninterrupted, tmp_path):
    fsdp = dict(use_torch_fsdp2=True, ddp_bucket_size=None)
    diffs = _run_chain([(4, 2, 1, fsdp), (2, 1, 1, DIST_OPT), (4, 2, 1, fsdp)], uninterrupted, tmp_path)
    print("max |loss - uninterrupted| per leg (FSDP2 EP 2, dist-opt EP 1 x DP 2, FSDP2 EP 2):", diffs)


@pytest.mark.slow  # ~14 s: TP 2 (+SP) x EP 2 on 4 ranks (distributed optimizer), one rank, 4 again
def test_moe_resume_tp2_ep2_to_tp1_ep1_and_back(uninterrupted, tmp_path):
    legs = [(4, 2, 2, DIST_OPT), (1, 1, 1, {}), (4, 2, 2, DIST_OPT)]
    diffs = _run_chain(legs, uninterrupted, tmp_path)
    print("max |loss - uninterrupted| per leg (TP 2 x EP 2, TP 1 x EP 1, TP 2 x EP 2):", diffs)
