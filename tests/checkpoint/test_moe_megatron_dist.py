"""MoE torch_dist checkpoints both ways, megatron-core 0.16.1 as the oracle (fp32): its
dist_checkpointing.save of a MoE GPT (4 experts top-2, a gated shared expert, QK-norm, alltoall) at
EP 1 and EP 2 reads into megafab's keys (routed experts under global indices, [E, 2f, h]) with
every tensor exact, and megafab.inference.load_model's MoE GPT gives its logits within 1e-5;
megafab's torch_dist written from those weights loads strictly into megatron-core at EP 2 and EP 1
(every key and `_extra_state` object it asks for) with the same values. The legacy torch format's
expert-rank files (mp_rank_00_<EP>) read and write both ways too, and megatron-core's EP 2 checkpoint
loads into a megafab training state (--load --finetune) at EP 1, EP 2 and TP 2 x EP 2 with its
logits (1e-5)."""

import pytest
import torch

from megafab.checkpoint import megatron_dist
from megafab.checkpoint.layout import MODEL_PREFIX, from_stored
from megafab.convert.checkpoint import write_checkpoint
from megafab.inference.load import load_model
from megafab.run.fork_ranks import run_ranks
from tests.helpers import mcore
from tests.helpers.mcore_moe_gpt import (
    EXPERTS,
    global_name,
    megafab_config,
    megatron_args,
    megatron_moe_ranks,
)

TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def _state(model, ep_rank, local):
    return {global_name(k, ep_rank, local): v.clone() for k, v in model.state_dict().items()
            if torch.is_tensor(v)}


def _mcore_save(rank, world, root):
    from megatron.core import parallel_state as ps

    from tests.helpers.mcore_moe_gpt import gpt_model

    with megatron_moe_ranks(ep=world):
        model = gpt_model()
        common = {"args": megatron_args(expert_model_parallel_size=world), "iteration": 10,
                  "checkpoint_version": 3.0}
        mcore.save(model, root, common=common)
        logits = mcore.logits(model, TOKENS)
        return _state(model, ps.get_expert_model_parallel_rank(), EXPERTS // world), logits


def _mcore_load(rank, world, path):
    from megatron.core import parallel_state as ps

    from tests.helpers.mcore_moe_gpt import gpt_model

    with megatron_moe_ranks(ep=world):
        model = gpt_model(seed=99)  # other values: the load must overwrite every one
        mcore.load(model, path)
        return _state(model, ps.get_expert_model_parallel_rank(), EXPERTS // world)


def _expected_full(ranks: list) -> dict:
    """megatron-core names (global experts) -> tensor, merged over the EP ranks."""
    out = {}
    for sd in ranks:
        out.update(sd[0] if isinstance(sd, tuple) else sd)
    return out


def _megafab_full(path, cfg) -> dict:
    source = megatron_dist.TorchDistSource(path, cfg.model)
    stored = source.read_all(MODEL_PREFIX)
    names = {k: k[len(MODEL_PREFIX):] for k in stored}
    return {names[k]: from_stored(names[k], v, cfg.model) for k, v in stored.items()}


def _as_megatron(sd: dict) -> dict:
    """A full megafab state dict under megatron-core's SequentialMLP names (global expert numbers)."""
    from megafab.param_names import is_routed_expert, sequential_expert_name

    out = {}
    for name, t in sd.items():
        if is_routed_expert(name):
            out.update({sequential_expert_name(name, e): t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


@pytest.mark.slow  # ~25 s: megatron-core ranks at EP 1 and EP 2
def test_megatron_core_moe_checkpoints_read_exactly_at_ep1_and_ep2(tmp_path):
    cfg = megafab_config()
    reference = None
    for ep in (1, 2):
        root = str(tmp_path / f"ep{ep}")
        results = run_ranks(_mcore_save, ep, root, timeout=240)
        expected = _expected_full(results)
        reference = reference or expected
        assert expected.keys() == reference.keys()
        assert all(torch.equal(expected[k], reference[k]) for k in expected)  # EP does not change the model
        ours = _as_megatron(_megafab_full(root + "/iter_0000010", cfg))
        assert ours.keys() == expected.keys(), sorted(set(ours) ^ set(expected))
        for k in expected:
            assert torch.equal(ours[k], expected[k]), k
        model, _ = load_model(root)  # megafab.inference: the whole MoE GPT, logits as megatron-core's
        with torch.no_grad():
            logits = model(TOKENS).transpose(0, 1)
        err = (logits - results[0][1]).abs().max().item()
        assert err < 1e-5, (ep, err)


@pytest.mark.slow  # ~25 s
def test_megafab_moe_torch_dist_loads_into_megatron_core_at_ep2_and_ep1(tmp_path):
    cfg = megafab_config()
    saved = _expected_full(run_ranks(_mcore_save, 1, str(tmp_path / "src"), timeout=240))
    sd = _megafab_full(str(tmp_path / "src" / "iter_0000010"), cfg)
    path = write_checkpoint(str(tmp_path / "ours"), sd, cfg, iteration=3)
    for ep in (2, 1):
        loaded = _expected_full(run_ranks(_mcore_load, ep, path, timeout=240))
        assert loaded.keys() == saved.keys()
        for k in saved:
            assert torch.equal(loaded[k], saved[k]), (ep, k)


# ---- the legacy torch format: one file per TP x (PP x) EP rank ------------------------------------
def _mcore_legacy_save(rank, world, root):
    """Megatron-LM's legacy save of each rank's state_dict_for_save_checkpoint, named by EP rank."""
    import os

    from megatron.core import parallel_state as ps

    from megafab.param_names import rank_dir
    from tests.helpers.mcore_moe_gpt import gpt_model

    with megatron_moe_ranks(ep=world):
        model = gpt_model()
        ep_rank = ps.get_expert_model_parallel_rank()
        directory = os.path.join(root, "iter_0000010", rank_dir(0, 0, 1, ep_rank, world))
        os.makedirs(directory, exist_ok=True)
        torch.save({"args": megatron_args(expert_model_parallel_size=world), "iteration": 10,
                    "checkpoint_version": 3.0, "model": model.state_dict_for_save_checkpoint()},
                   os.path.join(directory, "model_optim_rng.pt"))
        if rank == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("10")
        return _state(model, ep_rank, EXPERTS // world)


def _mcore_legacy_load(rank, world, path):
    import os

    from megatron.core import parallel_state as ps

    from megafab.param_names import rank_dir
    from tests.helpers.mcore_moe_gpt import gpt_model

    with megatron_moe_ranks(ep=world):
        model = gpt_model(seed=99)
        ep_rank = ps.get_expert_model_parallel_rank()
        file = os.path.join(path, rank_dir(0, 0, 1, ep_rank, world), "model_optim_rng.pt")
        model.load_state_dict(torch.load(file, weights_only=False)["model"], strict=True)
        return _state(model, ep_rank, EXPERTS // world)


@pytest.mark.slow  # ~25 s: megatron-core ranks
def test_legacy_expert_rank_files_both_ways(tmp_path):
    from megafab.checkpoint.megatron_legacy import LegacySource

    cfg = megafab_config()
    saved = _expected_full(run_ranks(_mcore_legacy_save, 2, str(tmp_path / "mcore"), timeout=240))
    source = LegacySource(str(tmp_path / "mcore" / "iter_0000010"))
    assert (source.ep, source.pp) == (2, 1)  # mp_rank_00_001 names EP rank 1 here, not a stage
    sd = {k[len(MODEL_PREFIX):]: source.full_tensor(k[len(MODEL_PREFIX):]) for k in source.stored}
    ours = _as_megatron(sd)
    assert ours.keys() == saved.keys(), sorted(set(ours) ^ set(saved))
    for k in saved:
        assert torch.equal(ours[k], saved[k]), k
    path = write_checkpoint(str(tmp_path / "ours"), sd, cfg, iteration=3, ckpt_format="torch", ep=2)
    loaded = _expected_full(run_ranks(_mcore_legacy_load, 2, path, timeout=240))
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k


def _megafab_finetune_logits(rank, world, root, ep, save=None, tp=1):
    from megafab.checkpoint import checkpointing
    from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
    from megafab.distributed.topology import build_topology
    from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
    from tests.helpers.checkpoint import full_logits
    from tests.helpers.mcore_moe_gpt import MODEL, MOE
    from tests.helpers.tiny import tiny_config

    cfg = tiny_config(tp=tp, style={}, **{**MODEL, **MOE}, dp=world // tp, expert_model_parallel_size=ep,
                      micro_batch_size=1, global_batch_size=world // tp, load=root, finetune=True, save=save,
                      sequence_parallel=tp > 1)
    topo = build_topology(tp=tp, ep=ep)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker, dtype=torch.float32)
    optimizer = build_optimizer(cfg, topo, model)
    state = TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))
    checkpointing.load_checkpoint(state)
    if save is not None:  # megafab's training save (torch_dist, experts and their extra states)
        checkpointing.save_checkpoint(state)
    return full_logits(state, TOKENS)


@pytest.mark.slow  # ~50 s
def test_megatron_core_moe_checkpoint_finetunes_in_megafab_at_ep1_and_ep2(tmp_path):
    root = str(tmp_path / "mcore")
    results = run_ranks(_mcore_save, 2, root, timeout=240)  # saved at EP 2
    expected, saved = results[0][1], _expected_full(results)
    for tp, ep in ((1, 1), (1, 2), (2, 2)):  # TP 2 x EP 2: every expert split over expert-TP 2 as well
        ours = str(tmp_path / "ours1") if ep == 1 else None
        got = run_ranks(_megafab_finetune_logits, tp * ep, root, ep, ours, tp, timeout=240)
        for logits in got:
            err = (logits[..., :128] - expected).abs().max().item()
            assert err < 1e-5, (tp, ep, err)
    # megafab's training save at EP 1 loads strictly into megatron-core at EP 2, every value exact
    loaded = _expected_full(run_ranks(_mcore_load, 2, str(tmp_path / "ours1" / "iter_0000000"), timeout=240))
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
