"""The planner's counts and bytes against the real model, optimizer and saved activations."""

import pytest
import torch

from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, build_model_chunks, masked_mean_loss
from megafab.optim.memory import SavedActivations
from megafab.plan.planner import format_plan, in_flight_chunks, plan
from megafab.run.fork_ranks import run_ranks
from tests.helpers.driver import measured_after_one_step
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, batch, context, tiny_config

LAYOUTS = [dict(pp=1), dict(pp=2), dict(pp=2, num_layers_per_virtual_pipeline_stage=1),
           dict(pp=4, untie_embeddings_and_output_weights=True)]


def _count(chunks):
    return sum(p.numel() for c in chunks for p in c.parameters())


@pytest.mark.parametrize("style", [GPT2_STYLE, LLAMA_STYLE], ids=["gpt2", "llama"])
def test_parameter_counts_equal_the_real_model_for_pipeline_layouts(style):
    for layout in LAYOUTS:
        layout = dict(layout)
        pp = layout.pop("pp")
        cfg = tiny_config(pp=pp, style=style, global_batch_size=2 * pp, **layout)
        vpp = cfg.parallel.virtual_pipeline_model_parallel_size or 1
        for stage in plan(cfg):
            real = _count(build_model_chunks(cfg.model, context(dtype=torch.float32), pp, stage.pp_rank, vpp))
            assert stage.params == real, (layout, stage.pp_rank, stage.params, real)


def _tp_counts(rank, world):
    topo = build_topology(tp=world)
    out = []
    for style in (GPT2_STYLE, LLAMA_STYLE):
        cfg = tiny_config(tp=world, style=style)
        real = _count([GPTModel(cfg.model, context(topo.group("tp"), dtype=torch.float32))])
        out.append((plan(cfg)[0].params, real))
    return out


def test_parameter_counts_equal_the_real_model_under_tp2():
    for planned, real in run_ranks(_tp_counts, 2, timeout=120)[0]:
        assert planned == real


def _state_bytes(rank, world):
    results = []
    for tp, dist_opt in ((1, False), (1, True), (2, False)):
        cfg = tiny_config(tp=tp, dp=world // tp, bf16=True, use_distributed_optimizer=dist_opt,
                          global_batch_size=2 * (world // tp), hidden_size=64, num_layers=2)
        report, stage = measured_after_one_step(cfg)
        results.append((tp, dist_opt, report.num_params, stage.params,
                        (report.weights_bytes, report.grads_bytes, report.optimizer_bytes),
                        (stage.weights_bytes, stage.grads_bytes, stage.optimizer_bytes)))
    return results


def test_weight_grad_optimizer_bytes_match_measured_within_one_percent():
    for tp, dist_opt, real_params, params, measured, planned in run_ranks(_state_bytes, 2, timeout=120)[0]:
        print(f"TP{tp} dist-opt {dist_opt}: params {params} (real {real_params}); measured w/g/opt {measured}"
              f" planned {planned}")
        assert params == real_params
        for m, p in zip(measured, planned):
            assert abs(m - p) <= 0.01 * m, (tp, dist_opt, measured, planned)


def _saved_and_planned(rank, world, style_name, overrides):
    style = LLAMA_STYLE if style_name == "llama" else GPT2_STYLE
    dims = dict(hidden_dropout=0.1, attention_dropout=0.1, num_layers=4, hidden_size=64,
                num_attention_heads=4, seq_length=32, vocab_size=128, make_vocab_size_divisible_by=32,
                sequence_parallel=world > 1)
    cfg = tiny_config(tp=world, style=style, **dims, **overrides)
    dtype = torch.bfloat16 if cfg.precision.bf16 else torch.float32
    group = torch.distributed.new_group(list(range(world))) if world > 1 else None
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, rank, 0, "cpu", tracker)
    model = GPTModel(cfg.model, context(tp_group=group, sequence_parallel=world > 1, tracker=tracker,
                                        dtype=dtype))
    tokens, labels, mask = batch(cfg.model, micro_batch=2)
    with SavedActivations(model.parameters()) as saved:
        loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.float().backward()
    return saved.bytes, plan(cfg, kernels="cpu")[0].forward_saved_bytes


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-sp"])
@pytest.mark.parametrize("style,overrides", [("gpt2", {"bf16": True}), ("llama", {"bf16": True}),
                                             ("llama", {}), ("gpt2", {"recompute_granularity": "selective"})],
                         ids=["gpt2-bf16", "llama-bf16", "llama-fp32", "gpt2-selective"])
def test_activation_prediction_within_10_percent_of_saved_tensors(tp, style, overrides):
    # CPU SDPA with attention dropout runs the math kernel in fp32 (the planner's kernels="cpu")
    measured, predicted = run_ranks(_saved_and_planned, tp, style, overrides, timeout=60)[0]
    print(f"{style} {overrides} TP{tp}: measured {measured} predicted {predicted} "
          f"ratio {predicted / measured:.3f}")
    assert abs(predicted - measured) <= 0.10 * measured


def test_in_flight_micro_batches_follow_the_schedules():
    assert [in_flight_chunks(4, 1, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_chunks(4, 1, 0, 2) == 2
    # interleaved, first stage: pp * (1 + (pp - 1) / (pp * vpp)) micro-batches of a stage's layers
    assert in_flight_chunks(4, 2, 0, 8) / 2 == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight_chunks(1, 1, 0, 8) == 1


def test_full_recompute_plans_less_activation_memory_and_prints_every_stage():
    base = dict(pp=2, num_layers=8, hidden_size=64, seq_length=32, global_batch_size=8, bf16=True)
    none = plan(tiny_config(**base))
    full = plan(tiny_config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                            **base))
    assert full[0].activation_peak_bytes * 2 < none[0].activation_peak_bytes
    text = format_plan(tiny_config(**base), none, gpu_memory_gb=80)
    assert "stage 0" in text and "stage 1" in text and "fits" in text and "FLOPs/iteration" in text


def test_estimate_memory_tool_and_pretrain_dry_run_print_the_plan(capsys):
    from pretrain_gpt import main as pretrain_main
    from tools.estimate_memory import main as estimate_main

    flags = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "8", "--bf16",
             "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
             "--use-distributed-optimizer"]
    assert estimate_main(flags + ["--world-size", "8", "--gpu-memory-gb", "1"]) == 0
    tool = capsys.readouterr().out
    assert "TP 2 x PP 2 x DP 2" in tool and "stage 1" in tool and "fits" in tool
    assert not torch.distributed.is_initialized()
    assert pretrain_main(flags[:-5] + ["--dry-run"]) == 0
    assert "stage 0" in capsys.readouterr().out and not torch.distributed.is_initialized()
