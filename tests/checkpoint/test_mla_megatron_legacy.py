"""Megatron's legacy per-rank files (--ckpt-format torch) of DeepSeek-V3's shape in small (multi-latent
attention, dense then MoE layers with the expert bias, one MTP layer; tests/helpers/mcore_deepseek.py):
megafab's file loads into megatron-core 0.16.1's GPTModel with load_state_dict(strict=True) -- MLA's
projections' `_extra_state` and no standard attention's, the routers' expert_bias buffers -- with
megafab's values, and megafab reads it back equal."""

from __future__ import annotations

import glob

import torch

from megafab.checkpoint import checkpointing, safe_pickle
from megafab.run.fork_ranks import run_ranks
from tests.helpers.mcore_deepseek import deepseek_config, deepseek_state, megatron_deepseek
from tests.helpers.mcore_moe import megatron_moe_on_cpu

LEGACY = dict(ckpt_format="torch", no_save_optim=True, no_save_rng=True)


def _values(model) -> dict:
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
    return out


def _save(rank, world, root):
    state = deepseek_state(save=root, **LEGACY)
    g = torch.Generator().manual_seed(3)
    module = state.model[0].module
    with torch.no_grad():  # every weight and expert bias off its initialization
        tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        for t in (tensors[name] for name in _values(module)):
            t.add_(torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype) * 0.05)
    checkpointing.save_checkpoint(state)
    return _values(module)


def _megatron_load(rank, world, root):
    [file] = glob.glob(f"{root}/iter_0000000/mp_rank_00/model_optim_rng.pt")
    saved = safe_pickle.load(file)["model"]
    with megatron_moe_on_cpu():
        model = megatron_deepseek(deepseek_config(), seed=1)
        model.load_state_dict(saved, strict=True)  # raises on a missing or unexpected key
        return _values(model), [k for k in saved if k.endswith("_extra_state")]


def _megafab_load(rank, world, root):
    state = deepseek_state(load=root, finetune=True, **LEGACY)
    assert checkpointing.load_checkpoint(state) == 0
    return _values(state.model[0].module)


def test_megafab_legacy_deepseek_file_loads_strictly_into_megatron_core_and_back(tmp_path):
    root = str(tmp_path / "legacy")
    ours = run_ranks(_save, 1, root, timeout=240)[0]
    theirs, extra = run_ranks(_megatron_load, 1, root, timeout=240)[0]
    assert "decoder.layers.0.self_attention.linear_kv_up_proj._extra_state" in extra
    assert not any("linear_qkv" in k for k in extra)
    assert theirs.keys() == ours.keys() and any(k.endswith("expert_bias") for k in ours)
    for name, value in ours.items():
        assert torch.equal(theirs[name], value), name
    again = run_ranks(_megafab_load, 1, root, timeout=240)[0]
    for name, value in ours.items():
        assert torch.equal(again[name], value), name
