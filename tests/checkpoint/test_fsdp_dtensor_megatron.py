"""fsdp_dtensor's keys against Megatron-LM HEAD's own rules (fixtures/fsdp_dtensor_keys.json, made by
make_fsdp_dtensor_keys.py from HEAD's fsdp_dtensor_checkpoint.py: SwiGLU split, experts renamed to
global indices) applied to megatron-core 0.16.1's live MoE GPT (SequentialMLP experts, SwiGLU, a gated
shared expert) at EP 2.

megatron-core's model at EP 2 has exactly the fixture's live names; its weights written under the
fixture's disk names (each rank its experts, fc1 halves as HEAD splits them) load into megafab with
megatron-core's logits (1e-5); megafab's own fsdp_dtensor save of those weights has exactly the disk
names HEAD gives, and the optimizer's names are the model's under one wrapper `module.` more, as
megafab writes them. Under --bf16, megatron-core's Float16Module inside stand-ins for the DDP
wrapper and MegatronFSDP gives the weights no extra `module.` and the optimizer's names one, as
megafab writes them. What this does not check: Megatron-FSDP's own save and load (CUDA-only)."""

import copy
import dataclasses
import json
import os

import torch

from megafab.checkpoint import dcp_io, directory
from megafab.checkpoint import fsdp_dtensor_keys as fk
from megafab.checkpoint.layout import Shard
from megafab.convert.checkpoint import read_checkpoint, write_checkpoint
from megafab.inference.load import load_model
from megafab.run.fork_ranks import run_ranks
from tests.helpers import mcore
from tests.helpers.mcore_moe_gpt import megafab_config, megatron_args, megatron_moe_ranks

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "fsdp_dtensor_keys.json")
KEYS = json.load(open(FIXTURE))
TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def _megatron_fsdp_save(rank, world, root):
    """This rank's megatron-core model written as Megatron-FSDP writes it (fp32: 'model.module.')."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tests.helpers.mcore_moe_gpt import gpt_model

    with megatron_moe_ranks(ep=world):
        model = gpt_model()
        keys = KEYS["ranks"][str(ps.get_expert_model_parallel_rank())]
        live = {"module." + k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
        params = {"module.module." + k for k, _ in model.named_parameters()}
        assert set(live) == set(keys["model"]) and params == set(keys["optimizer"])
        shards = {}
        for name, value in live.items():
            disk = keys["model"][name]
            parts = [value] if len(disk) == 1 else value.chunk(2, dim=0)  # [gate; up] -> _w, _v
            for key, part in zip(sorted(disk, key=lambda k: k.endswith("_v")), parts):
                shard = Shard.whole(part.contiguous())
                shard.write = rank == 0 or ".experts." in key  # the dense weights are the same on every rank
                shards["model." + key] = shard
        objects = {"args": megatron_args(expert_model_parallel_size=world), "iteration": 10,
                   "checkpoint_version": 3.0} if rank == 0 else {}
        path = directory.iteration_dir(root, 10)
        dcp_io.save_shards(shards, path, objects)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("10")
        return mcore.logits(model, TOKENS)


def _disk_keys(kind: str) -> set:
    return {d for r in KEYS["ranks"].values() for disks in r[kind].values() for d in disks}


def test_megatron_fsdp_names_load_into_megafab_and_megafab_writes_them(tmp_path):
    root = str(tmp_path / "megatron")
    logits = run_ranks(_megatron_fsdp_save, 2, root, timeout=240)[0]
    model, _ = load_model(root)
    with torch.no_grad():
        ours = model(TOKENS).transpose(0, 1)
    assert (ours - logits).abs().max().item() < 1e-5
    sd, _ = read_checkpoint(root)
    cfg = megafab_config()
    path = write_checkpoint(str(tmp_path / "ours"), sd, cfg, ckpt_format="fsdp_dtensor")
    stored = dcp_io.read_metadata(path).state_dict_metadata
    assert {k[len("model."):] for k in stored if k.startswith("model.")} == _disk_keys("model")
    # the optimizer's keys megafab would write for those weights (the save above holds no optimizer)
    model, optim = fk.model_prefix(cfg), fk.optim_prefix(cfg)
    ours = {optim[len(fk.OPTIM_STATE):] + k[len(model):] for k in stored if k.startswith(model)}
    assert ours == _disk_keys("optimizer")


class _Delegating(torch.nn.Module):
    """A wrapper under attribute `module`; delegate_state_dict: its state_dict is the inner one's, as
    megatron-core's DDP wrappers' (_BaseDataParallel); MegatronFSDP keeps nn.Module's own."""

    def __init__(self, module, delegate_state_dict: bool):
        super().__init__()
        self.module, self.delegate = module, delegate_state_dict

    def state_dict(self, *args, **kwargs):
        owner = self.module if self.delegate else super()
        return owner.state_dict(*args, **kwargs)


def _bf16_names(rank, world):
    """Megatron's names of a --bf16 model under Megatron-FSDP: the DDP wrapper over MegatronFSDP over
    megatron-core's own Float16Module (the wrappers stand-ins, Float16Module real)."""
    from megatron.core.transformer.module import Float16Module

    from tests.helpers.mcore_moe_gpt import gpt_model

    with megatron_moe_ranks(ep=world):
        model = gpt_model()
        config = copy.copy(model.config)
        config.bf16 = True
        wrapped = _Delegating(_Delegating(Float16Module(config, model), False), True)
        return set(wrapped.state_dict()), {n for n, _ in wrapped.named_parameters()}


def test_bf16_prefixes_are_megatrons_float16module_under_megatron_fsdp():
    """Float16Module's state_dict adds no `module.` to the weights' keys; its attribute adds one to the
    optimizer's (the parameter names)."""
    weights, params = run_ranks(_bf16_names, 1, timeout=120)[0]
    cfg = megafab_config()
    bf16 = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, bf16=True))
    name = "decoder.final_layernorm.weight"
    assert {"model." + k for k in weights if k.endswith(name)} == {fk.model_prefix(bf16) + name}
    assert fk.optim_prefix(bf16)[len(fk.OPTIM_STATE):] + name in params
    assert fk.group_meta_prefix(bf16)[len(fk.GROUP_META):] + name in params
