"""--transformer-impl transformer_engine with context parallelism, FSDP2 and selective recompute,
through tests/helpers/fake_te.py (TE's documented API, plain math; its DotProductAttention does TE's
CP over the cp_group it is given): the config rules accept the combinations; CP 2 with each
--cp-comm-type (TE's DotProductAttention given the CP group, its ranks and TE's comm-type name),
FSDP2 / Megatron-FSDP at DP 2 (3 driver steps) and selective recompute of each module equal the
local single-process model in float64; under FP8 every recompute runs through te.checkpoint and
every TE module call, forward and recompute, runs in FP8. The same on a GPU with TE:
benchmarks/gpu_device_check.sh (not yet run on one)."""

from __future__ import annotations

import pytest
import torch

from megafab.config.core import ConfigError
from megafab.distributed.context_parallel import context_parallel_masked_mean, split_for_context_parallel
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.moe.balancing import LossScale
from megafab.model.moe.settings import MoESettings
from megafab.model.te import TE_CP_COMM_TYPES, TETransformerLayer, te_to_local_name
from megafab.model.te_wrap import TEWrappedTransformerLayer
from megafab.model.transformer import LayerContext
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import train_step
from tests.helpers import fake_te
from tests.helpers.driver import (
    MICRO,
    STEPS,
    driver_state,
    full_values,
    make_samples,
    micro_batches,
    reference_run,
)
from tests.helpers.fake_te import te_name
from tests.helpers.mcore_mla import MLA_STYLE
from tests.helpers.mcore_mtp import MOE
from tests.helpers.tiny import LLAMA_STYLE, batch, reference_model, tiny_config

TE = dict(transformer_impl="transformer_engine", bf16=True)
STYLE = dict(LLAMA_STYLE, num_query_groups=2)


def _compare(loss, grads, ref_loss, ref_grads):
    assert abs(loss - ref_loss) < 1e-10, (loss, ref_loss)
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() < 1e-10, name
    return len(grads)


def _loss_and_grads(model, tokens, labels, mask):
    loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    return loss.item(), {te_to_local_name(n): p.grad for n, p in model.named_parameters()}


def test_rules_accept_te_with_cp_fsdp_fp8_and_selective_recompute():
    for comm in ("p2p", "allgather", "a2a"):
        assert tiny_config(style=STYLE, dp=2, context_parallel_size=2, cp_comm_type=comm,
                           **TE).parallel.context_parallel_size == 2
    for fsdp in ({"use_torch_fsdp2": True}, {"use_megatron_fsdp": True}):
        assert tiny_config(dp=2, fp8_format="hybrid", **fsdp, **TE).precision.fp8_format == "hybrid"
    for module in ("core_attn", "layernorm", "mlp"):
        tiny_config(recompute_granularity="selective", recompute_modules=[module], fp8_format="e4m3", **TE)
    # TE's CP attention takes no per-document mask: named, with the fix
    with pytest.raises(ConfigError, match="Transformer Engine's CP attention, which takes no per-document"):
        tiny_config(style=STYLE, dp=2, context_parallel_size=2, cp_comm_type="allgather",
                    reset_attention_mask=True, dataloader_inter_document_masking=True, **TE)


@pytest.mark.parametrize("extra", [["--use-torch-fsdp2"], ["--use-megatron-fsdp", "--fp8-format", "hybrid"],
                                   ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
                                   ["--recompute-granularity", "selective",
                                    "--recompute-modules", "mlp", "core_attn"]],
                         ids=["fsdp2", "megatron-fsdp+fp8", "cp2", "selective"])
def test_cli_on_cpu_refuses_only_te_absence(extra, monkeypatch, capsys):
    """pretrain on CPU without TE: exit 2, one line naming the flag and the fix, whatever the layout."""
    from megafab.cli.pretrain import main  # deferred: the console script, as users run it

    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
             "--vocab-size", "128", "--train-iters", "1", "--mock-data", "--dry-run", "--bf16",
             "--transformer-impl", "transformer_engine"] + extra
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("  - ")]
    assert exit_info.value.code == 2
    te_lines = [line for line in lines if "transformer_engine (a CUDA build; this run is on cpu)" in line]
    assert len(te_lines) == 1 and "use --transformer-impl local" in te_lines[0], lines
    flag = "--fp8-format" if "--fp8-format" in extra else "--transformer-impl transformer_engine"
    assert te_lines[0].startswith(f"  - {flag} needs transformer_engine")
    assert len(lines) == 1, lines


# ---- context parallelism ----------------------------------------------------------------------------
def _cp_parity(rank, world, comm, record, variant):
    topo = build_topology(cp=world)
    extra = VARIANTS[variant]
    local_cfg = tiny_config(style=STYLE, **extra).model
    te_cfg = tiny_config(style=STYLE, **TE, **extra).model
    tokens, labels, mask = batch(local_cfg)
    ref = _loss_and_grads(reference_model(local_cfg), tokens, labels, mask)
    group = topo.group("cp")
    ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, cp_group=group,
                       cp_comm_type=comm)
    model = GPTModel(te_cfg, ctx)
    kind = TETransformerLayer if variant == "te-layer" else TEWrappedTransformerLayer
    assert all(type(layer) is kind for layer in model.decoder.layers.values())

    def local(t):
        return split_for_context_parallel(t, 1, rank, world)

    loss = context_parallel_masked_mean(model(local(tokens), labels=local(labels)), local(mask), group)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        torch.distributed.all_reduce(p.grad, group=group)
        grads[te_to_local_name(name)] = p.grad / world
    cp_built = [kw["cp_comm_type"] for kind, _, kw in record if kind == "cp"]
    windowed = variant == "wrapped+window"  # megafab's CP core attention: no TE attention built
    assert cp_built == ([] if windowed else [TE_CP_COMM_TYPES[comm]] * te_cfg.num_layers), cp_built
    return _compare(loss.item(), grads, *ref)


VARIANTS = {"te-layer": {},  # TE's dense layer, TE's DotProductAttention doing CP
            "wrapped+core_attn-recompute": dict(recompute_granularity="selective",
                                                recompute_modules=["core_attn"]),
            "wrapped+window": dict(window_size=(5, 0), window_attn_skip_freq=2)}  # megafab's CP attention


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("comm", ["p2p", "allgather", "a2a"])
def test_te_context_parallel_equals_single_process(monkeypatch, comm, variant):
    record = fake_te.install(monkeypatch)
    if variant == "wrapped+window" and comm == "p2p":  # megafab's K/V ring has no banded blocks
        with pytest.raises(ConfigError, match="--window-size with --context-parallel-size 2 and --cp-comm"):
            tiny_config(style=STYLE, dp=2, context_parallel_size=2, cp_comm_type=comm, **TE,
                        **VARIANTS[variant])
        return
    assert min(run_ranks(_cp_parity, 2, comm, record, variant, timeout=120)) > 0


# ---- FSDP2 ------------------------------------------------------------------------------------------
def _fsdp_parity(rank, world, fsdp, recompute):
    gbs = MICRO * world * 2
    extra = dict(recompute_granularity="selective", recompute_modules=["mlp", "layernorm"]) \
        if recompute else {}
    cfg = tiny_config(style=STYLE, dp=world, micro_batch_size=MICRO, global_batch_size=gbs, lr=1e-2,
                      lr_decay_style="constant", train_iters=STEPS, **fsdp, **TE, **extra)
    ref_cfg = tiny_config(style=STYLE, lr=1e-2)
    samples = make_samples(cfg.model, gbs * STEPS)
    reference = reference_run(ref_cfg, samples, gbs)
    state = driver_state(cfg, torch.float64)
    chunk = state.model[0].module
    kind = TEWrappedTransformerLayer if recompute else TETransformerLayer
    assert all(isinstance(layer, kind) for layer in chunk.decoder.layers.values())

    checked = 0
    for step in range(STEPS):
        data = micro_batches(samples, step * gbs, state.topology.dp_rank, world,
                             cfg.training.num_micro_batches)
        metrics = train_step(state, data)
        ref_norm, ref_params = reference[step]
        assert abs(metrics["grad_norm"] - ref_norm) < 1e-10 * max(1.0, ref_norm), (metrics, ref_norm)
        for name, p in chunk.named_parameters():
            assert type(p).__name__ == "DTensor", name  # every TE parameter sharded over DP
            err = (full_values(p, None) - ref_params[te_to_local_name(name)]).abs().max().item()
            assert err < 1e-10, (step, name, err)
            checked += 1
    return checked


@pytest.mark.parametrize("fsdp,recompute", [({"use_torch_fsdp2": True}, False),
                                            ({"use_megatron_fsdp": True}, True)],
                         ids=["torch-fsdp2", "megatron-fsdp+selective"])
def test_te_fsdp2_equals_single_process(monkeypatch, fsdp, recompute):
    fake_te.install(monkeypatch)
    assert min(run_ranks(_fsdp_parity, 2, fsdp, recompute, timeout=180)) > 0


# ---- selective recompute, each module; FP8 through te.checkpoint ------------------------------------
DENSE_MODULES = ("core_attn", "layernorm", "mlp")
DEEPSEEK_MODULES = ("mla_up_proj", "moe", "shared_experts", "moe_act")


def _models(module, recompute=True, **extra):
    """(local model without recompute, TE model recomputing `module`), same seed, float64."""
    if module in DENSE_MODULES:
        style, sizes, moe = STYLE, {}, None
    else:
        style, sizes = MLA_STYLE, dict(num_layers=2, mtp_num_layers=1)
        moe = MoESettings(**MOE, moe_grouped_gemm=module == "moe_act")
    recompute = dict(recompute_granularity="selective", recompute_modules=[module]) if recompute else {}
    if module == "moe_act":  # the config rule reads the MoE flags
        sizes.update(MOE, moe_grouped_gemm=True)
    local_cfg = tiny_config(style=style, **sizes).model
    te_cfg = tiny_config(style=style, **sizes, **TE, **recompute, **extra)

    def build(m, precision=None):
        ctx = LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, precision=precision,
                           moe=moe, moe_loss_scale=LossScale() if moe else None)
        return GPTModel(m, ctx)
    return build(local_cfg), build(te_cfg.model, te_cfg.precision)


def _run(model, tokens, labels, mask):
    if model.mtp_depths:
        model.mtp.loss_scale.set(1.0)
        model.ctx.moe_loss_scale.set(1.0)
    loss = model(tokens, labels=labels, loss_mask=mask)
    (loss * mask).sum().backward()
    return loss


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("module", DENSE_MODULES + DEEPSEEK_MODULES)
def test_te_selective_recompute_of_each_module_equals_local(monkeypatch, module, fp8):
    record = fake_te.install(monkeypatch)
    local, te_model = _models(module, **({"fp8_format": "hybrid"} if fp8 else {}))
    assert any(isinstance(layer, TEWrappedTransformerLayer) for layer in te_model.decoder.layers.values())
    tokens, labels, mask = batch(local.cfg)
    te_model.train()
    start = len(record)
    losses = [_run(model, tokens, labels, mask) for model in (local, te_model)]
    assert (losses[0] - losses[1]).abs().max() < 1e-10
    moe_layers = {"decoder.layers.1.", "mtp.layers.0.transformer_layer."}
    dense = module in DENSE_MODULES  # standard attention: TE's names map back (param_names)
    expected = {(n if dense else te_name(n, moe_layers)): p for n, p in local.named_parameters()}
    for name, p in te_model.named_parameters():
        ref = expected[te_to_local_name(name) if dense else name]
        assert (p.grad - ref.grad).abs().max() < 1e-10, name
    run = record[start:]
    checkpoints = [kw for kind, _, kw in run if kind == "checkpoint"]
    calls = [on for kind, _, on in run if kind == "fp8"]
    _, plain = _models(module, recompute=False, **({"fp8_format": "hybrid"} if fp8 else {}))
    start = len(record)
    _run(plain, tokens, labels, mask)
    plain_calls = sum(kind == "fp8" for kind, _, _ in record[start:])
    holds_te = module not in ("layernorm", "moe_act")  # a fused norm / the experts' activation: no TE
    assert (len(calls) > plain_calls) == holds_te, (module, len(calls), plain_calls)  # TE modules re-run
    if fp8:  # TE's checkpoint keeps each module's forward FP8 state for its recompute in backward
        if module not in ("layernorm", "mla_up_proj", "moe_act"):  # (those discard outputs instead)
            assert checkpoints
            assert all(not kw["use_reentrant"] and not kw["distributed"] for kw in checkpoints)
        assert calls and all(calls), module
    else:
        assert not checkpoints and not any(calls)


def test_te_full_recompute_with_mtp_under_fp8_runs_through_te_checkpoint(monkeypatch):
    """Full uniform recompute (every decoder layer, and the MTP depth outside the chunk's FP8 region,
    as megatron-core's MTP layer) under FP8: each through te.checkpoint, every TE module call in FP8
    (no new fp8_autocast for a recompute), the local model's loss and gradients."""
    record = fake_te.install(monkeypatch)
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    sizes = dict(num_layers=2, mtp_num_layers=1)
    local_cfg = tiny_config(style=MLA_STYLE, **sizes).model
    te_cfg = tiny_config(style=MLA_STYLE, **sizes, **TE, **full, fp8_format="hybrid")
    moe = MoESettings(**MOE)
    models = [GPTModel(m, LayerContext(None, False, torch.float64, torch.device("cpu"), 1234, precision=pr,
                                       moe=moe, moe_loss_scale=LossScale()))
              for m, pr in ((local_cfg, None), (te_cfg.model, te_cfg.precision))]
    tokens, labels, mask = batch(local_cfg)
    losses = [_run(model, tokens, labels, mask) for model in models]
    assert (losses[0] - losses[1]).abs().max() < 1e-10
    moe_layers = {"decoder.layers.1.", "mtp.layers.0.transformer_layer."}
    expected = {te_name(n, moe_layers): p for n, p in models[0].named_parameters()}
    for name, p in models[1].named_parameters():
        assert (p.grad - expected[name].grad).abs().max() < 1e-10, name
    assert len([kind for kind, _, _ in record if kind == "checkpoint"]) == 3  # 2 layers + the MTP depth
    autocasts = [kw for kind, _, kw in record if kind == "fp8_autocast"]
    assert len(autocasts) == 2  # the chunk's region and the MTP layer's own: none in backward
    calls = [on for kind, _, on in record if kind == "fp8"]
    assert len(calls) > 0 and all(calls)
