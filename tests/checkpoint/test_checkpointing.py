"""Checkpoint format in-process: blocks under global shapes, safe metadata, atomic directory
contract, and a bitwise round trip of model + optimizer state across TP/PP/DP layouts."""

import os
import pickle

import pytest
import torch

from megafab.checkpoint import CheckpointError, checkpointing, dcp_io, directory
from megafab.checkpoint.boxes import Box
from megafab.checkpoint.layout import Shard
from megafab.checkpoint.megatron_dist import TorchDistSource, read_common
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.run.fork_ranks import run_ranks
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from megafab.training.step import train_step
from tests.helpers.checkpoint import read_everything
from tests.helpers.tiny import LLAMA_STYLE, batch, tiny_config


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/megafab_pwned_by_checkpoint",))


def test_metadata_with_code_is_refused_not_run(tmp_path):
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(_Exploit(), f)
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        dcp_io.read_metadata(str(tmp_path))
    assert not os.path.exists("/tmp/megafab_pwned_by_checkpoint")


def test_tracker_is_validated(tmp_path):
    assert directory.latest_iteration(str(tmp_path)) is None
    (tmp_path / directory.TRACKER).write_text("abc")
    with pytest.raises(CheckpointError, match="not an iteration number"):
        directory.latest_iteration(str(tmp_path))


def test_commit_renames_then_points_the_tracker(tmp_path):
    root = str(tmp_path)
    for it in (5, 10):
        os.makedirs(directory.iteration_dir(root, it) + ".tmp")
        directory.commit_checkpoint(root, it)
    assert directory.latest_iteration(root) == 10
    os.makedirs(directory.iteration_dir(root, 10) + ".tmp")  # re-save of the same iteration
    open(directory.iteration_dir(root, 10) + ".tmp/new", "w").close()
    directory.commit_checkpoint(root, 10)
    assert sorted(os.listdir(root)) == ["iter_0000005", "iter_0000010", directory.TRACKER]
    assert os.listdir(directory.iteration_dir(root, 10)) == ["new"]


def _blocks_round_trip(rank, world, path):
    full = torch.arange(48, dtype=torch.float32).view(8, 6)
    if world == 4:  # rows split in two, replicated twice (DP): replicas are written once
        r = rank % 2
        dcp_io.save_shards({"w": Shard((8, 6), [Box((r * 4, 0), (4, 6))], [full[r * 4:(r + 1) * 4].clone()]),
                            "step": Shard.whole(torch.tensor(3.0))}, path)
        return None
    out = torch.zeros(8, 2)
    step = torch.tensor(0.0)
    dcp_io.load_shards({"w": Shard((8, 6), [Box((0, rank * 2), (8, 2))], [out]),
                        "step": Shard.whole(step)}, path)
    return torch.equal(out, full[:, rank * 2:rank * 2 + 2]) and step.item() == 3.0


def test_blocks_saved_in_one_split_load_in_another(tmp_path):
    run_ranks(_blocks_round_trip, 4, str(tmp_path), timeout=120)
    assert run_ranks(_blocks_round_trip, 3, str(tmp_path), timeout=120) == [True] * 3
    chunks = dcp_io.read_metadata(str(tmp_path)).state_dict_metadata["w"].chunks
    assert len(chunks) == 2  # DP replicas de-duplicated


# ---- whole training state across layouts ----------------------------------------------------------
def _state(tp, pp, dp, dist_opt, save=None, load=None, **overrides):
    cfg = tiny_config(tp=tp, pp=pp, style=LLAMA_STYLE, dp=dp, vocab_size=112, micro_batch_size=1,
                      global_batch_size=2 * dp, use_distributed_optimizer=dist_opt, ddp_bucket_size=1000,
                      lr=1e-2, train_iters=10, bf16=True, save=save, load=load,
                      untie_embeddings_and_output_weights=False, **overrides)
    topo = build_topology(tp=tp, pp=pp)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker)
    optimizer = build_optimizer(cfg, topo, model)
    return TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))


def _train_and_save(rank, world, path):
    state = _state(tp=2, pp=1, dp=2, dist_opt=True, save=path)
    for step in range(2):
        mbs = []
        for k in range(state.cfg.training.num_micro_batches):
            tokens, labels, mask = batch(state.cfg.model, 1, seed=step * 10 + k * 2 + state.topology.dp_rank)
            mbs.append({"tokens": tokens, "labels": labels, "loss_mask": mask})
        train_step(state, iter(mbs))
    checkpointing.save_checkpoint(state)


def _load_and_resave(rank, world, src, dst):
    state = _state(tp=1, pp=2, dp=2, dist_opt=True, save=dst, load=src)
    assert checkpointing.load_checkpoint(state) == 2
    assert state.iteration == 2 and state.consumed_train_samples == 8
    checkpointing.save_checkpoint(state)
    if not state.topology.is_last_stage:
        return None
    # The last stage's tied output layer is not stored: it must hold the stored embedding.
    chunk = state.model[0].module
    entry = next(e for e in state.optimizer.entries if e.model_param is chunk.output_layer.weight)
    return (chunk.output_layer.weight.detach().clone(), entry.param_range,
            state.optimizer.optimizer.state[entry.main]["exp_avg"].clone())


@pytest.mark.smoke
def test_tp2_dp2_state_loads_into_pp2_dp2_and_saves_back_bit_identical(tmp_path):
    """bf16 + distributed optimizer (fp32 main copies and Adam moments in flat DP ranges), SwiGLU,
    tied embeddings: TP2 x DP2 -> TP1 x PP2 x DP2 -> saved again: every tensor identical."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    run_ranks(_train_and_save, 4, first, timeout=180)
    tied = run_ranks(_load_and_resave, 4, first, second, timeout=180)
    a, b = read_everything(directory.iteration_dir(first, 2)), read_everything(
        directory.iteration_dir(second, 2))
    for weight, (lo, hi), exp_avg in tied[2:]:  # last stage, both DP ranks
        assert torch.equal(weight, a["model.embedding.word_embeddings.weight"])
        assert torch.equal(exp_avg, a["optim.embedding.word_embeddings.weight.exp_avg"].view(-1)[lo:hi])
        assert exp_avg.abs().sum() > 0
    assert sorted(a) == sorted(b)
    assert any(k.endswith(".main_param") for k in a) and "model.output_layer.weight" not in a
    ffn = b["model.decoder.layers.0.mlp.linear_fc2.weight"].shape[1]
    assert a["model.decoder.layers.0.mlp.linear_fc1.weight"].shape == (2, ffn, 32)  # [gate; up] view
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert TorchDistSource(directory.iteration_dir(first, 2)).step == 2.0
    common_a = read_common(directory.iteration_dir(first, 2))["megafab"]
    common_b = read_common(directory.iteration_dir(second, 2))["megafab"]
    assert common_a["scheduler"] == common_b["scheduler"]
    assert common_a["layout"] == {"world_size": 4, "tp": 2, "pp": 1, "dp": 2, "vpp": 1}


def _flags_round_trip(rank, world, path):
    saver = _state(tp=1, pp=1, dp=2, dist_opt=False, save=path, no_save_optim=True, no_save_rng=True)
    saver.iteration, saver.consumed_train_samples = 7, 28
    with torch.no_grad():
        for p in saver.model[0].parameters():
            p.add_(1.0)
    checkpointing.save_checkpoint(saver)
    weights = [p.detach().clone() for p in saver.model[0].parameters()]

    loader = _state(tp=1, pp=1, dp=2, dist_opt=False, load=path)
    assert checkpointing.load_checkpoint(loader) == 7
    resumed = (loader.iteration, loader.consumed_train_samples, len(loader.optimizer.optimizer.state))
    same = all(torch.equal(a, b) for a, b in zip(weights, loader.model[0].parameters()))
    # bf16 model: the fp32 main copies must follow the loaded weights even without optimizer state
    mains = all(torch.equal(e.main, e.model_param.float()) for e in loader.optimizer.entries)

    tuner = _state(tp=1, pp=1, dp=2, dist_opt=False, load=path, finetune=True)
    checkpointing.load_checkpoint(tuner)
    tuned = all(torch.equal(a, b) for a, b in zip(weights, tuner.model[0].parameters()))
    return resumed, same, mains, tuner.iteration, tuned


def test_no_save_optim_and_rng_then_resume_and_finetune(tmp_path):
    results = run_ranks(_flags_round_trip, 2, str(tmp_path), timeout=180)
    assert results == [((7, 28, 0), True, True, 0, True)] * 2
    stored = TorchDistSource(directory.iteration_dir(str(tmp_path), 7)).stored
    assert stored and all(k.startswith("model.") for k in stored)
    assert os.listdir(os.path.join(directory.iteration_dir(str(tmp_path), 7), "rng")) == []


def _mismatch(rank, world, path):
    saver = _state(tp=1, pp=2, dp=1, dist_opt=False, save=path)
    checkpointing.save_checkpoint(saver)
    wider = _state(tp=1, pp=2, dp=1, dist_opt=False, load=path,
                   ffn_hidden_size=2 * saver.cfg.model.ffn_hidden_size)
    try:
        checkpointing.load_checkpoint(wider)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_different_model_is_refused_with_one_message_on_every_rank(tmp_path):
    messages = run_ranks(_mismatch, 2, str(tmp_path), timeout=180)
    assert all(m and "--ffn-hidden-size: checkpoint 64, this run 128" in m for m in messages), messages


def _weights_only_needs_finetune(rank, world, path):
    from megafab.convert.checkpoint import write_checkpoint

    source = _state(tp=1, pp=1, dp=1, dist_opt=False)
    sd = {n: p.detach().clone() for n, p in source.model[0].module.named_parameters()}
    write_checkpoint(path, sd, source.cfg)
    resume = _state(tp=1, pp=1, dp=1, dist_opt=False, load=path)
    try:
        checkpointing.load_checkpoint(resume)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    resume = _state(tp=1, pp=1, dp=1, dist_opt=False, load=path, finetune=True)
    assert checkpointing.load_checkpoint(resume) == 0
    return refused


def test_weights_only_checkpoint_without_finetune_is_refused_by_name(tmp_path):
    [message] = run_ranks(_weights_only_needs_finetune, 1, str(tmp_path), timeout=120)
    assert message and "holds weights only" in message and "--finetune" in message
