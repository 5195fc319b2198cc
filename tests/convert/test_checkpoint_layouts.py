"""HF -> megafab checkpoint -> loaded by a TP2 x PP2 run (--finetune) -> saved by it -> exported:
every tensor survives exactly and transformers' logits equal the original model's."""

import pytest
import torch
from safetensors.torch import load_file

from megafab import checks
from megafab.checkpoint import checkpointing
from megafab.config import Config
from megafab.convert import export_hf, import_hf, read_checkpoint, write_checkpoint
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.run.fork_ranks import run_ranks
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from tests.helpers.hf_tiny import VOCAB, hf_gpt2, hf_llama


def _load_then_save(rank, world, flat, load_dir, save_dir):
    cfg = Config.from_flat({**flat, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                            "micro_batch_size": 1, "train_iters": 1, "lr": 1e-3, "mock_data": True,
                            "padded_vocab_size": None, "load": load_dir, "save": save_dir, "finetune": True})
    checks.finalize(cfg, world_size=world)
    topo = build_topology(tp=2, pp=2)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(cfg.training.seed, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker, dtype=torch.float32)
    optimizer = build_optimizer(cfg, topo, model)
    state = TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))
    checkpointing.load_checkpoint(state)
    state.iteration = 7
    checkpointing.save_checkpoint(state)
    return sorted(n for n, _ in model[0].module.named_parameters())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_tp2_pp2_save_exports_the_same_model(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = hf_gpt2() if arch == "gpt2" else hf_llama(groups=2)
    hf.save_pretrained(tmp_path / "hf")
    sd, cfg = import_hf(str(tmp_path / "hf"), tp=2)
    write_checkpoint(str(tmp_path / "imported"), sd, cfg)

    names = run_ranks(_load_then_save, 4, cfg.to_flat(), str(tmp_path / "imported"), str(tmp_path / "saved"),
                      timeout=120)
    assert any("decoder.layers.1." in n for n in names[2]) and not any("layers.0." in n for n in names[2])

    saved, saved_cfg = read_checkpoint(str(tmp_path / "saved"))
    assert checkpointing.latest_iteration(str(tmp_path / "saved")) == 7
    assert set(saved) == set(sd)
    for key, tensor in sd.items():
        assert torch.equal(saved[key], tensor), key

    export_hf(saved, saved_cfg, str(tmp_path / "out"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf(tokens).logits, rtol=0, atol=1e-4)
