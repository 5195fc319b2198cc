"""FSDP2's communication in the step-time model (megafab.plan.fsdp) as megafab runs it: each layer's
gather and reduce-scatter are NCCL calls of their own (each paying the ring's latency), the
reduction dtype follows megafab's mixed precision, gathers repeat every micro-batch and the
reduce-scatter runs once, backward gathers and reduce-scatters share the links; and the attention
time of a micro-batch is linear in its size."""

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.plan import fsdp
from megafab.plan.collectives import collective_seconds, group_placement
from megafab.plan.machines import machine
from megafab.plan.planner import fsdp_layer_units, layer_param_split, plan
from megafab.plan.state_memory import grad_bytes
from megafab.plan.step_time import layer_passes, predict

H100 = machine("h100-sxm-80gb")
MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
         "--max-position-embeddings", "2048", "--vocab-size", "32000", "--bf16",
         "--untie-embeddings-and-output-weights", "--dry-run"]


def layer_groups(cfg):
    """A dense layer's FSDP2 groups taken together."""
    return fsdp.groups(cfg, H100, fsdp_layer_units(cfg, 0, cfg.parallel.tensor_model_parallel_size))


def config(world, *flags, batch=None):
    gbs = batch or world
    return config_from_args(MODEL + ["--micro-batch-size", "1", "--global-batch-size", str(gbs), *flags],
                            world_size=world)


def test_attention_of_a_micro_batch_is_linear_in_its_size():
    """M = b s tokens already counts the micro-batch: twice the samples, twice the attention FLOPs."""
    attention = {}
    for mbs in (1, 2):
        cfg = config_from_args(MODEL + ["--micro-batch-size", str(mbs), "--global-batch-size", "8"],
                               world_size=1)
        fwd, bwd = layer_passes(cfg, H100)
        attention[mbs] = (fwd.attention - H100.kernel_overhead_s, bwd.attention - H100.kernel_overhead_s)
    assert attention[2][0] == pytest.approx(2 * attention[1][0])
    assert attention[2][1] == pytest.approx(2 * attention[1][1])


@pytest.mark.parametrize("bf16_reduce", [False, True])
def test_a_unit_gathers_in_the_model_dtype_and_reduces_in_megafabs_reduction_dtype(bf16_reduce):
    cfg = config(768, "--use-torch-fsdp2", *(["--grad-reduce-in-bf16"] if bf16_reduce else []))
    n = fsdp_layer_units(cfg, 0, 1)[2][0]  # the MLP's group
    unit = fsdp.unit(cfg, H100, n)
    group = group_placement(cfg, H100, "dp", "cp")
    assert group.size == 768 and group.nodes == 96
    assert unit.gather == pytest.approx(collective_seconds(H100, "all_gather", 2 * n, group))
    reduce_bytes = 2 if bf16_reduce else 4  # megafab reduces in fp32 unless --grad-reduce-in-bf16
    assert grad_bytes(cfg) == reduce_bytes
    assert unit.reduce == pytest.approx(collective_seconds(H100, "reduce_scatter", reduce_bytes * n, group))
    assert unit.copy_out == pytest.approx(H100.memory_seconds(2 * 2 * n, kernels=1))


@pytest.mark.parametrize("moe", [False, True])
def test_a_layers_groups_are_megafabs_fsdp2_units(moe):
    """fsdp_layer_units against the modules megafab.distributed.fsdp shards: the layer itself (its
    norms), its attention block, its MLP without the routed experts, and the routed experts."""
    from megafab.distributed.fsdp import expert_units, layer_units
    from megafab.model.gpt import build_model_chunks
    from megafab.model.transformer import LayerContext
    from megafab.pipeline_split import PipelineSplit
    from tests.helpers.tiny import LLAMA_STYLE, tiny_config

    extra = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1)) if moe else {}
    cfg = tiny_config(style=LLAMA_STYLE, num_layers=2, **extra)
    ctx = LayerContext(None, False, torch.float32, torch.device("cpu"), 1234, moe=cfg.moe)
    (chunk,) = build_model_chunks(cfg.model, ctx, 1, 0, 1, PipelineSplit.from_config(cfg))
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    for index, layer in enumerate(chunk.decoder.layers.values()):
        units = layer_units([layer])
        assert [u is layer for u in units] == [False, False, True]
        experts = sum(count(u) for u in expert_units(layer))
        attention, mlp = count(units[0]), count(units[1]) - experts
        built = [(count(layer) - attention - mlp - experts, 0), (attention, 0), (mlp, 0)] + \
            ([(0, experts)] if experts else [])
        assert fsdp_layer_units(cfg, index, 1) == built, index
        assert sum(map(sum, built)) == layer_param_split(cfg, index, 1)[0]
    assert any(expert_units(chunk)) == moe


def test_every_layer_pays_the_rings_latency_in_each_of_its_collectives():
    """At DP 768 over 96 nodes a ring call costs ~0.9 ms before any byte moves (NCCL's LL protocol,
    its cheapest), and each of a layer's 3 FSDP2 groups (norms, attention, MLP) gathers in forward
    and backward and reduce-scatters: with layers this small the step exposes nearly all 9 calls per
    layer (an alpha amortized over the whole step would hide them)."""
    cfg = config(768, "--use-torch-fsdp2")
    group = group_placement(cfg, H100, "dp", "cp")
    latency = collective_seconds(H100, "all_gather", 1.0, group)
    assert latency > 0.9e-3
    pred = predict(cfg, H100, plan(cfg))
    fsdp_seconds = pred.breakdown["fsdp_gather"] + pred.breakdown["dp_comm"]
    layers, calls = cfg.model.num_layers, 3 * len(fsdp_layer_units(cfg, 0, 1))
    compute = pred.breakdown["gemm"] + pred.breakdown["attention"] + pred.breakdown["memory_bound"]
    assert compute < calls * layers * latency / 4  # the collectives cannot hide
    assert fsdp_seconds > calls * layers * latency - compute


def test_gathers_repeat_every_micro_batch_and_the_reduce_scatter_runs_once():
    """megafab's no_sync: every micro-batch gathers in forward and again (resharded) in backward and
    accumulates its unsharded gradient; only the last reduce-scatters."""
    one = predict(cfg1 := config(64, "--use-torch-fsdp2"), H100, plan(cfg1)).breakdown
    two = predict(cfg2 := config(64, "--use-torch-fsdp2", batch=128), H100, plan(cfg2)).breakdown
    assert cfg1.training.num_micro_batches == 1 and cfg2.training.num_micro_batches == 2
    assert two["dp_comm"] == pytest.approx(one["dp_comm"])
    assert two["fsdp_gather"] > 2 * one["fsdp_gather"]  # two micro-batches' gathers + accumulation
    layers, n = cfg2.model.num_layers, layer_param_split(cfg2, 0, 1)[0]
    root = plan(cfg2)[0].params - layers * n  # embedding, final norm, output layer
    accumulate = layers * layer_groups(cfg2).accumulate + fsdp.unit(cfg2, H100, root).accumulate
    assert two["fsdp_gather"] == pytest.approx(2 * (one["fsdp_gather"] + accumulate))


def test_no_reshard_after_forward_drops_the_backward_gathers():
    """What resharding costs: each layer's backward gather and its copy-out, less what the layers'
    backward (and the output layer's) hides of them."""
    resharded = predict(cfg := config(768, "--use-torch-fsdp2"), H100, plan(cfg)).breakdown
    kept = predict(cfg := config(768, "--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"),
                   H100, plan(cfg)).breakdown
    unit = layer_groups(cfg)
    layers = cfg.model.num_layers
    compute = resharded["gemm"] + resharded["attention"] + resharded["memory_bound"]
    extra = resharded["fsdp_gather"] - kept["fsdp_gather"]
    assert layers * unit.gather - compute < extra <= layers * (unit.gather + unit.copy_out) + 1e-12
    assert resharded["dp_comm"] > kept["dp_comm"]  # the gathers also share the links with the reduce-scatters


def test_backward_gathers_and_reduce_scatters_share_the_links():
    """One chunk of 4 layers, each gather and reduce-scatter 1 s, forward 2 s, backward 1.5 s per
    layer: alone either hides behind a layer's backward, together they expose 0.5 s in each of the
    2 middle layers of the reducing micro-batch (docstring timeline)."""
    cfg = config(64, "--use-torch-fsdp2")
    layer = fsdp.Layer(fsdp.Unit(gather=1.0, reduce=1.0), forward=2.0, backward=1.5)
    root = fsdp.Unit()
    out = fsdp.stage_seconds(cfg, [(root, [layer] * 4)], output_cover=0.0, accumulating=False)
    # forward: the first layer's gather waits, the rest hide; backward: the last layer's gather waits
    assert out.per_micro_batch == pytest.approx(1.0 + 1.0)
    assert out.reducing == pytest.approx(0.5 + 0.5)
    assert out.tail == pytest.approx(1.0)  # the first layer's reduce-scatter after the last backward
    covered = fsdp.stage_seconds(cfg, [(root, [layer] * 4)], output_cover=1.0, accumulating=False)
    assert covered.per_micro_batch == pytest.approx(1.0)  # the output layer's backward covers it


def test_fsdp2_layouts_do_not_get_transformer_engines_tp_overlap():
    """The estimator does not model TE's userbuffers TP overlap (--tp-comm-overlap, refused) beside
    FSDP2's gathers; the distributed optimizer's layout at the same TP gets it."""
    flags = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
    fsdp2 = config(16, "--use-torch-fsdp2", *flags)
    assert predict(fsdp2, H100, plan(fsdp2), tp_comm_overlap=True).step_time_s == \
        predict(fsdp2, H100, plan(fsdp2), tp_comm_overlap=False).step_time_s
    dist = config(16, "--use-distributed-optimizer", *flags)
    assert predict(dist, H100, plan(dist), tp_comm_overlap=True).step_time_s < \
        predict(dist, H100, plan(dist), tp_comm_overlap=False).step_time_s
