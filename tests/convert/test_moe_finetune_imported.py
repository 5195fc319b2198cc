"""An imported HF Mixtral trains in megafab: megafab-convert's torch_dist of a tiny random
transformers Mixtral loads into training states with --finetune at EP 1 and EP 2 x DP 2 with
transformers' logits (1e-5), a training save after loading (EP 1) exports back bit for bit, and 20 steps
of finetuning on one batch lower its loss."""

import pytest
import torch

pytest.importorskip("transformers")

from megafab import checks
from megafab.checkpoint import checkpointing  # noqa: E402
from megafab.config import Config  # noqa: E402
from megafab.convert import export_hf, import_hf, read_checkpoint, write_checkpoint  # noqa: E402
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed  # noqa: E402
from megafab.distributed.topology import build_topology  # noqa: E402
from megafab.run.fork_ranks import run_ranks  # noqa: E402
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler  # noqa: E402
from megafab.training.step import train_step  # noqa: E402
from tests.helpers.checkpoint import full_logits  # noqa: E402
from tests.helpers.hf_moe_tiny import hf_mixtral  # noqa: E402
from tests.helpers.tiny import batch  # noqa: E402

TOKENS = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))


def _state(world, ep, flat, load_dir, save_dir=None):
    cfg = Config.from_flat({**flat, "micro_batch_size": 1, "global_batch_size": world, "train_iters": 20,
                            "lr": 3e-3, "min_lr": 3e-3, "mock_data": True, "padded_vocab_size": None,
                            "load": load_dir, "save": save_dir, "finetune": True,
                            "expert_model_parallel_size": ep, "seq_length": 16})
    checks.finalize(cfg, world_size=world)
    topo = build_topology(ep=ep)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(cfg.training.seed, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker, dtype=torch.float32)
    optimizer = build_optimizer(cfg, topo, model)
    state = TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))
    checkpointing.load_checkpoint(state)
    return state


def _logits_then_save(rank, world, ep, flat, load_dir, save_dir):
    state = _state(world, ep, flat, load_dir, save_dir)
    logits = full_logits(state, TOKENS)
    if save_dir is not None:
        state.iteration = 5
        checkpointing.save_checkpoint(state)
    return logits


def _finetune(rank, world, flat, load_dir):
    state = _state(world, 1, flat, load_dir)
    tokens, labels, mask = batch(state.cfg.model, 1, seed=3)
    mb = {"tokens": tokens, "labels": labels, "loss_mask": mask}
    return [train_step(state, iter([mb]))["lm loss"] for _ in range(20)]


def test_imported_mixtral_loads_saves_exports_and_finetunes(tmp_path):
    hf = hf_mixtral()
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        expected = hf(TOKENS).logits
    sd, cfg = import_hf(str(tmp_path / "hf"), make_vocab_size_divisible_by=8)
    write_checkpoint(str(tmp_path / "imported"), sd, cfg)
    flat = cfg.to_flat()
    for world, ep in ((1, 1), (2, 2)):
        save = str(tmp_path / "saved1") if ep == 1 else None  # EP > 1 saves need expert-DP buckets (ddp23)
        logits = run_ranks(_logits_then_save, world, ep, flat, str(tmp_path / "imported"), save, timeout=180)
        for out in logits:
            assert (out[..., :100] - expected).abs().max().item() < 1e-5, (world, ep)
    saved, saved_cfg = read_checkpoint(str(tmp_path / "saved1"))
    assert set(saved) == set(sd) and all(torch.equal(saved[k], sd[k]) for k in sd)
    export_hf(saved, saved_cfg, str(tmp_path / "out"))
    from safetensors.torch import load_file

    original, exported = load_file(str(tmp_path / "hf" / "model.safetensors")), \
        load_file(str(tmp_path / "out" / "model.safetensors"))
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
    losses = run_ranks(_finetune, 1, flat, str(tmp_path / "imported"), timeout=180)[0]
    assert losses[-1] < 0.5 * losses[0], losses
