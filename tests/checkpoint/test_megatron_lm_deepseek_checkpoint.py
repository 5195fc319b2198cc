"""DeepSeek-V3's shape in small saved by Megatron-LM core_v0.16.1's own training code (the committed
fixture tests/checkpoint/fixtures/megatron_lm_deepseek/, written by make_megatron_lm_deepseek.py:
multi-latent attention with a query LoRA and YaRN, a dense first layer then three MoE layers with a
shared expert, sigmoid group routing with the expert bias, one MTP layer; fp32, the distributed
optimizer saved fully reshardable, iteration 2 of 4):

- megafab.inference.load_model gives megatron-core's recorded logits within 1e-5;
- pretrain_gpt.py resumes it with its optimizer and the fixture's own flags: iterations 3 and 4 log
  Megatron-LM's own lm losses within 1e-5.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megafab.inference.load import load_model
from tests.helpers.launch import losses
from tests.helpers.main_ranks import main_stdout

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_lm_deepseek"
REFERENCE = torch.load(FIXTURE / "reference.pt", weights_only=True)


def test_load_model_gives_megatron_lms_logits():
    model, cfg = load_model(str(FIXTURE))
    m = cfg.model
    assert (m.multi_latent_attention, m.q_lora_rank, m.mtp_num_layers, cfg.moe.num_experts,
            cfg.moe.moe_router_score_function) == (True, 24, 1, 4, "sigmoid")
    names = dict(model.named_parameters())
    assert "mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.weight" in names
    with torch.no_grad():
        logits = model(REFERENCE["tokens"]).transpose(0, 1)
    assert logits.shape == REFERENCE["logits"].shape == (2, 32, 128)
    err = (logits - REFERENCE["logits"]).abs().max().item()
    assert err < 1e-5 and REFERENCE["logits"].std() > 0.1, err
    print(f"MEASURED logits max abs err {err!r}")


def test_pretrain_resumes_megatron_lms_deepseek_checkpoint_with_its_optimizer(tmp_path, mock_data_cache):
    load = tmp_path / "load"
    shutil.copytree(FIXTURE, load)
    flags = REFERENCE["model_flags"] + REFERENCE["train_flags"] + mock_data_cache + [
        "--load", str(load), "--log-interval", "1"]
    out = main_stdout(1, flags, tmp_path / "run")
    assert "optimizer starts fresh" not in out
    logged = losses(out)
    assert sorted(logged) == [3, 4]
    for it in (3, 4):
        assert abs(logged[it] - REFERENCE["lm_losses"][it - 1]) < 1e-5, (it, logged, REFERENCE["lm_losses"])
    print(f"MEASURED resumed: megafab {logged} Megatron-LM {REFERENCE['lm_losses'][2:]}")
