"""GPT with MoE layers under model parallelism: pipeline stages and virtual chunks place MoE layers
by their global index, and TP 2 + sequence parallel (EP 1; expert TP 1: each TP rank routes its
own s/tp tokens of the residual stream through whole experts; expert TP 2: experts sharded)
equals the single-process model in float64 (loss, the logged losses and every gradient as
finalize_model_grads leaves them: sequence-parallel params and whole experts, replicated over TP,
summed over it; TP shards gathered)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, build_model_chunks, masked_mean_loss
from megafab.model.moe.balancing import LossScale
from megafab.model.moe.loss_logging import moe_loss_values
from megafab.model.moe.router import routers_of
from megafab.model.moe.settings import MoESettings
from megafab.model.transformer import LayerContext
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import LLAMA_STYLE, batch, full_grad, tiny_config

SETTINGS = MoESettings(num_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1, 1, 1), moe_aux_loss_coeff=1e-2,
                       moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=40)


def _ctx(settings=SETTINGS, tp_group=None, sp=False, tp_cp_group=None, etp_group=None):
    return LayerContext(tp_group, sp, torch.float64, torch.device("cpu"), 1234, moe=settings,
                        etp_group=etp_group, tp_ep_group=etp_group, tp_cp_group=tp_cp_group,
                        tp_dp_cp_group=tp_cp_group, moe_loss_scale=LossScale(0.5))


@pytest.mark.parametrize("pp,vpp,freq", [(2, 1, (0, 1, 1, 1)), (2, 2, (1, 0, 0, 1)), (1, 1, 2)])
def test_pipeline_chunks_place_moe_layers_by_global_index(pp, vpp, freq):
    m = tiny_config(style=LLAMA_STYLE, num_layers=8 if vpp > 1 else 4).model
    settings = MoESettings(num_experts=4, moe_layer_freq=freq if vpp == 1 or isinstance(freq, int)
                           else freq * 2)
    placed = {}
    for rank in range(pp):
        for chunk in build_model_chunks(m, _ctx(settings), pp=pp, pp_rank=rank, vpp=vpp):
            for number, layer in chunk.decoder.layers.items():
                placed[int(number)] = type(layer.mlp).__name__
                if placed[int(number)] == "MoELayer":
                    assert "router.weight" in dict(layer.mlp.named_parameters())
    assert sorted(placed) == list(range(m.num_layers))
    assert placed == {i: "MoELayer" if settings.is_moe_layer(i) else "MLP" for i in range(m.num_layers)}
    assert "MoELayer" in placed.values() and "MLP" in placed.values()


def _loss_and_grads(model, tokens, labels, mask, tp_group=None, etp: int = 1):
    loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False) and (etp > 1 or not getattr(p, "is_expert", False)):
            grads[name] = full_grad(p, tp_group)  # ETP = TP: experts sharded over the TP ranks
        else:  # expert TP 1: the experts are whole on every TP rank
            grads[name] = p.grad.clone()
            replicated = getattr(p, "sequence_parallel", False) or getattr(p, "is_expert", False)
            # (ETP 1: each TP rank's experts saw only its s/tp tokens: partial grads)
            if tp_group is not None and replicated:
                dist.all_reduce(grads[name], group=tp_group)
    return loss.item(), grads


def _logged(model, tp_cp_group=None):
    return moe_loss_values(SETTINGS, routers_of([model]), num_moe_layers=3, num_micro_batches=1,
                           tp_cp_group=tp_cp_group, tp_dp_cp_group=tp_cp_group)


def _tp_sp_rank(rank, world, etp):
    topo = build_topology(tp=world)
    m = tiny_config(tp=world, style=LLAMA_STYLE).model
    tokens, labels, mask = batch(m)
    reference = GPTModel(m, _ctx())
    ref_loss, ref_grads = _loss_and_grads(reference, tokens, labels, mask)
    ref_logged = _logged(reference)
    tp = topo.group("tp")
    model = GPTModel(m, _ctx(tp_group=tp, sp=True, tp_cp_group=tp, etp_group=tp if etp > 1 else None))
    loss, grads = _loss_and_grads(model, tokens, labels, mask, tp, etp)
    logged = _logged(model, tp)
    # z_loss is logged as Megatron logs it, this rank's own tokens' mean: the TP mean is the model's
    z_loss = torch.tensor(logged["z_loss"], dtype=torch.float64)
    dist.all_reduce(z_loss, group=tp)
    logged["z_loss"] = z_loss.item() / world
    assert abs(loss - ref_loss) < 1e-10
    assert grads.keys() == ref_grads.keys()
    errors = {name: (g - ref_grads[name]).abs().max().item() for name, g in grads.items()}
    # the logged losses are float32 score sums (as megatron-core's), so float32 precision
    return errors, {k: abs(v - ref_logged[k]) / ref_logged[k] for k, v in logged.items()}


@pytest.mark.parametrize("etp", [1, 2])
def test_gpt_moe_tensor_and_sequence_parallel_equals_single_process(etp):
    errors, logged = run_ranks(_tp_sp_rank, 2, etp, timeout=120)[0]
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-10, (worst, errors[worst])
    assert any("experts.local_experts" in n for n in errors) and any("router" in n for n in errors)
    assert logged.keys() == {"load_balancing_loss", "z_loss"} and max(logged.values()) < 1e-6, logged
