"""gpt-oss's MoE MLP in Megatron's torch_dist checkpoints, megatron-core 0.16.1 as the oracle (fp32):
its dist_checkpointing.save at EP 2 of a MoE GPT with clamped quick-GEGLU, the +1 offset and biases
on the router and every expert's fc1 / fc2 (tests/helpers/mcore_moe_gpt.py's GPT_OSS) reads into
megafab's keys with every tensor exact (expert biases under megatron-core's names, fc1's [gate;
linear] bias strided as its weight), megafab.inference.load_model gives its logits within 1e-5, and
megafab's torch_dist written from those weights loads strictly into megatron-core at EP 2 with the
same values."""

import torch

from megafab.checkpoint import megatron_dist
from megafab.checkpoint.layout import MODEL_PREFIX, from_stored
from megafab.convert.checkpoint import write_checkpoint
from megafab.inference.load import load_model
from megafab.param_names import is_routed_expert, sequential_expert_name
from megafab.run.fork_ranks import run_ranks
from tests.helpers import mcore
from tests.helpers.mcore_moe_gpt import (
    EXPERTS,
    GPT_OSS,
    global_name,
    megafab_config,
    megatron_args,
    megatron_moe_ranks,
)

TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
EP = 2


def _state(model):
    from megatron.core import parallel_state as ps

    rank, local = ps.get_expert_model_parallel_rank(), EXPERTS // EP
    return {global_name(k, rank, local): v.clone() for k, v in model.state_dict().items()
            if torch.is_tensor(v)}


def _mcore_save(rank, world, root):
    from tests.helpers.mcore_moe_gpt import gpt_model

    with megatron_moe_ranks(ep=world):
        model = gpt_model(gpt_oss=True)
        common = {"args": megatron_args(expert_model_parallel_size=world, **GPT_OSS), "iteration": 10,
                  "checkpoint_version": 3.0}
        mcore.save(model, root, common=common)
        return _state(model), mcore.logits(model, TOKENS)


def _mcore_load(rank, world, path):
    from tests.helpers.mcore_moe_gpt import gpt_model

    with megatron_moe_ranks(ep=world):
        model = gpt_model(seed=99, gpt_oss=True)  # other values: the load must overwrite every one
        mcore.load(model, path)
        return _state(model)


def _merged(ranks) -> dict:
    out = {}
    for sd in ranks:
        out.update(sd[0] if isinstance(sd, tuple) else sd)
    return out


def test_gpt_oss_moe_torch_dist_both_ways_with_megatron_core(tmp_path):
    cfg = megafab_config(**GPT_OSS)
    root = str(tmp_path / "mcore")
    results = run_ranks(_mcore_save, EP, root, timeout=240)
    expected = _merged(results)
    experts = "decoder.layers.1.mlp.experts.local_experts.3."
    assert {"decoder.layers.0.mlp.router.bias", experts + "linear_fc1.bias", experts + "linear_fc2.bias"} \
        <= set(expected)
    source = megatron_dist.TorchDistSource(root + "/iter_0000010", cfg.model)
    full_sd = {k[len(MODEL_PREFIX):]: from_stored(k[len(MODEL_PREFIX):], v, cfg.model)
               for k, v in source.read_all(MODEL_PREFIX).items()}
    ours = {}
    for name, full in full_sd.items():
        if is_routed_expert(name):
            ours.update({sequential_expert_name(name, e): full[e] for e in range(full.shape[0])})
        else:
            ours[name] = full
    assert ours.keys() == expected.keys(), sorted(set(ours) ^ set(expected))
    for k in expected:
        assert torch.equal(ours[k], expected[k]), k
    model, _ = load_model(root)
    assert model.decoder.layers["1"].mlp.experts.shape.act.clamp == GPT_OSS["activation_func_clamp_value"]
    with torch.no_grad():
        logits = model(TOKENS).transpose(0, 1)
    assert (logits - results[0][1]).abs().max().item() < 1e-5
    path = write_checkpoint(str(tmp_path / "ours"), full_sd, cfg, iteration=3)
    loaded = _merged(run_ranks(_mcore_load, EP, path, timeout=240))
    assert loaded.keys() == expected.keys()
    for k in expected:
        assert torch.equal(loaded[k], expected[k]), k
