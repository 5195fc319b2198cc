"""--fp8-param-gather under the distributed optimizer, through tests/helpers/fake_te.py (TE's
documented FP8-weight API with real e4m3 rounding, current scaling with the amax reduced over the
bucket's group): TE's linear weights are FP8 tensors whose raw data lives in uint8 param buffers
(1 byte per weight), float64 mains start from the weights' init values (not their FP8 rounding, as
Megatron's preserve_high_precision_init_val; kept only until the mains exist), and 3 steps at DP 1 and
DP 2 (with and without --overlap-param-gather; PP 2 x DP 2 too) give the same losses and weights,
which differ from the run without --fp8-param-gather; a save at step 2 resumed gives step 3's loss
and weights, and the checkpoint holds the weights dequantized. The rules; on a GPU with TE:
benchmarks/gpu_device_check.sh."""

from __future__ import annotations

import pytest
import torch

from megafab.checkpoint import checkpointing
from megafab.checkpoint import state as cs
from megafab.config.core import ConfigError
from megafab.distributed.fsdp import local_tensor, shard_range
from megafab.distributed.param_gather import finish_param_syncs
from megafab.errors import MegafabError
from megafab.model.fp8_params import INIT_VALUE, dequantized, is_fp8_param, quantized_init_context
from megafab.model.te import fp8_recipe
from megafab.optim.memory import measure_memory
from megafab.run.fork_ranks import run_ranks
from tests.helpers import fake_te, fake_te_fp8
from tests.helpers.checkpoint import make_state, read_everything, train
from tests.helpers.tiny import LLAMA_STYLE, tiny_config

FP8 = dict(style=dict(LLAMA_STYLE, num_query_groups=2), transformer_impl="transformer_engine", bf16=True,
           fp8_format="hybrid", fp8_param_gather=True)
TE_WEIGHTS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


def _state(world, overlap=False, fp8=True, pp=1, fsdp=False, **extra):
    over = dict(overlap_grad_reduce=True, overlap_param_gather=True) if overlap else {}
    if fsdp:
        over.update(use_torch_fsdp2=True, ddp_bucket_size=None)
    return make_state(1, world // pp, not fsdp, pp=pp, **{**FP8, "fp8_param_gather": fp8, **over, **extra})


def _values(state) -> dict[str, torch.Tensor]:
    finish_param_syncs(state.model)
    return {n: (dequantized(p) if is_fp8_param(p) else p.detach()).clone()
            for n, p in state.model[0].module.named_parameters()}


def _check_layout(state) -> int:
    """TE's linear weights are FP8, their raw data in uint8 buffers of 1 byte each; the rest not."""
    chunk = state.model[0]
    fp8 = {n: p for n, p in chunk.module.named_parameters() if is_fp8_param(p)}
    assert set(fp8) == {n for n, _ in chunk.module.named_parameters() if n.endswith(TE_WEIGHTS)}, set(fp8)
    uint8 = [(start, end, b) for start, end, b in chunk.param_buffers if b.dtype == torch.uint8]
    fp8_buckets = [b for b in chunk.buckets if b.fp8]
    assert uint8 and sum(b.numel() * b.element_size() for _, _, b in uint8) == \
        sum(b.numel for b in fp8_buckets)  # 1 byte per element, buckets padded to a multiple of DP
    padding = sum(b.numel for b in fp8_buckets) - sum(p.numel() for p in fp8.values())
    assert 0 <= padding < chunk.dp * len(fp8_buckets)
    assert chunk.param_buffer.dtype == torch.float64  # the other params' buffer: the model dtype
    for p in fp8.values():  # the raw data is a view of a uint8 buffer
        assert any(p._data.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for *_, b in uint8)
    mains = [e for e in state.optimizer.entries if e.fp8]
    assert mains and all(e.has_master and e.main.dtype == torch.float64 for e in mains)
    for e in mains:  # each starts from its weight's init value, of which the weight is the e4m3 rounding
        lo, hi = e.param_range
        rounded = dequantized(e.model_param).view(-1)[lo:hi]
        assert 0 < (e.main - rounded).abs().max() and \
            ((e.main - rounded).abs() <= e.main.abs() / 16 + 1e-6).all(), e.name
        assert not hasattr(e.model_param, INIT_VALUE)  # freed once the mains exist
    # the weights' memory: the param buffers (1 byte per FP8 weight) and each FP8 weight's fp32 scale
    report = measure_memory(state.model, state.optimizer)
    buffers = sum(b.numel() * b.element_size() for *_, b in chunk.param_buffers)
    assert report.weights_bytes == buffers + 4 * len(fp8)
    return len(fp8)


def _run(rank, world, overlap, fp8=True):
    state = _state(world, overlap, fp8)
    if fp8:
        assert _check_layout(state) == 4 * state.cfg.model.num_layers
    start = _values(state)
    losses = train(state, 3)
    values = _values(state)
    assert all(not torch.equal(values[n], start[n]) for n in start)  # FP8 weights too: TE's cast ran
    for e in (e for e in state.optimizer.entries if e.fp8 and world == 1):
        w, main = values[e.name].view(-1), e.main  # the weight: e4m3 rounding of its master (3 bits)
        assert 0 < (w - main).abs().max() and ((w - main).abs() <= main.abs() / 16 + 1e-6).all(), e.name
    return losses, values


def test_fp8_param_gather_dp2_with_and_without_overlap_equals_dp1(monkeypatch):
    fake_te.install(monkeypatch)
    (ref_losses, ref), = run_ranks(_run, 1, False, timeout=120)
    (plain_losses, _), = run_ranks(_run, 1, False, False, timeout=120)
    assert all(1e-8 < abs(a - b) < 0.05 * abs(b) for a, b in zip(ref_losses, plain_losses))  # FP8 rounds
    for overlap in (False, True):
        for losses, values in run_ranks(_run, 2, overlap, timeout=120):
            assert all(abs(a - b) < 1e-10 for a, b in zip(losses, ref_losses)), (overlap, losses, ref_losses)
            for name, v in values.items():
                assert (v - ref[name]).abs().max() < 1e-10, (overlap, name)
    # PP 2 x DP 2 with overlap: two chunks' FP8 buckets, the loss on the last stage
    losses = [r for r in run_ranks(_run_pipeline, 4, timeout=120) if r is not None]
    assert len(losses) == 2 and all(abs(a - b) < 1e-10 for r in losses for a, b in zip(r, ref_losses))
    # FSDP2 DP 2: FP8 shards gathered as uint8 through TE's FSDP2 hooks
    for losses, shards in run_ranks(_run_fsdp, 2, timeout=120):
        assert all(abs(a - b) < 1e-10 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        for name, (lo, hi, v) in shards.items():
            assert (v - ref[name].view(-1)[lo:hi]).abs().max() < 1e-10, name


def _run_fsdp(rank, world):
    gathered = []
    original = fake_te_fp8.Float8Tensor.fsdp_pre_all_gather

    def counted(self, mesh, outer_size, outer_stride, module, mp_policy):
        gathered.append(self._data.dtype)
        return original(self, mesh, outer_size, outer_stride, module, mp_policy)
    fake_te_fp8.Float8Tensor.fsdp_pre_all_gather = counted  # this rank's process only
    state = _state(world, fsdp=True)
    chunk = state.model[0]
    fp8 = {n for n, p in chunk.module.named_parameters() if is_fp8_param(local_tensor(p))}
    assert fp8 == {n for n, _ in chunk.module.named_parameters() if n.endswith(TE_WEIGHTS)}, fp8
    # the memory of an FP8 shard: its uint8 data (1 byte per element) and its fp32 scale
    weights = [p for n, p in chunk.module.named_parameters() if n in fp8]
    assert measure_memory(torch.nn.ParameterList(weights)).weights_bytes == \
        sum(local_tensor(p)._data.untyped_storage().nbytes() + 4 for p in weights)
    losses = train(state, 3)
    assert gathered and set(gathered) == {torch.uint8}  # FP8 weights gathered as their raw bytes
    shards = {}
    for name, p in chunk.module.named_parameters():
        local = local_tensor(p)
        shards[name] = (*shard_range(p), (dequantized(local) if name in fp8 else local).reshape(-1).clone())
    return losses, shards


def _run_pipeline(rank, world):
    state = _state(world, overlap=True, pp=2)
    losses = train(state, 3)
    return losses if state.topology.is_last_stage else None


# swiglu off: the fake TE's weights lack TE's tensor_model_parallel attributes, and a gated fc1 is then
# saved and read in different shapes (a fake-TE limit, with or without FP8 weights)
UNGATED = dict(FP8["style"], swiglu=False)


def _save_resume(rank, world, path, fsdp):
    saver = _state(world, save=path, style=UNGATED, fsdp=fsdp)
    train(saver, 2)
    checkpointing.save_checkpoint(saver)
    stored = read_everything(checkpointing.iteration_dir(path, 2))
    saved = _local_values(saver)
    loss = train(saver, 1)
    resumed = _state(world, load=path, style=UNGATED, fsdp=fsdp)
    assert checkpointing.load_checkpoint(resumed) == 2
    assert abs(train(resumed, 1)[0] - loss[0]) < 1e-12
    after, want = _local_values(resumed), _local_values(saver)
    assert all((after[n][2] - want[n][2]).abs().max() < 1e-12 for n in want)
    for name in (n for n in saved if n.endswith(TE_WEIGHTS)):  # dequantized, in the model dtype
        lo, hi, values = saved[name]
        assert torch.equal(stored[f"model.{name}"].reshape(-1)[lo:hi], values), name
        assert f"optim.{name}.main_param" in stored, name  # fp32 (here fp64) mains beside
    return 1


def _local_values(state) -> dict[str, tuple[int, int, torch.Tensor]]:
    """This rank's flat range of every weight (all of it under the distributed optimizer)."""
    finish_param_syncs(state.model)
    out = {}
    for name, p in state.model[0].module.named_parameters():
        local = local_tensor(p)
        values = dequantized(local) if is_fp8_param(local) else local.detach()
        out[name] = (*shard_range(p), values.reshape(-1).clone())
    return out


@pytest.mark.parametrize("fsdp", [False, True], ids=["distributed-optimizer", "fsdp2"])
def test_fp8_param_gather_save_and_resume(monkeypatch, tmp_path, fsdp):
    fake_te.install(monkeypatch)
    assert run_ranks(_save_resume, 2, str(tmp_path), fsdp, timeout=180) == [1, 1]


def _load_owning_no_fp8(rank, world):
    state = _state(world)
    chunk = state.model[0]
    if rank == 1:  # as if this rank's ranges held none of the FP8 weights (this process only)
        owned = cs.dp_owned_ranges
        cs.dp_owned_ranges = lambda chunks: {p: r for p, r in owned(chunks).items() if not is_fp8_param(p)}
    casts, cast = [], chunk.cast_fp8_shards
    chunk.cast_fp8_shards = lambda values: (casts.append(len(values)), cast(values))
    shards, gather = cs.model_shards_for_load(state, False)
    cs.gather_params(gather)
    return casts, 4 * state.cfg.model.num_layers


def test_fp8_load_casts_on_every_rank(monkeypatch):
    """TE's cast reduces the amax over DP: a rank that read none of the FP8 weights joins it too."""
    fake_te.install(monkeypatch)
    (read, n), (none, _) = run_ranks(_load_owning_no_fp8, 2, timeout=60)
    assert read == [n] and none == [0]  # one cast each, rank 1 with nothing of its own


def test_quantized_init_falls_back_to_fp8_model_init(monkeypatch):
    """TE renamed fp8_model_init to quantized_model_init (TE 2.9): either builds FP8 weights."""
    fake_te.install(monkeypatch)
    import transformer_engine.pytorch as te

    precision = tiny_config(dp=2, use_distributed_optimizer=True, **FP8).precision
    for renamed in (False, True):
        if renamed:
            monkeypatch.setattr(te, "fp8_model_init", te.quantized_model_init, raising=False)
            monkeypatch.delattr(te, "quantized_model_init")
        with quantized_init_context(precision, fp8_recipe):
            inside = te.Linear(32, 16, params_dtype=torch.float64)
        assert is_fp8_param(inside.weight) and not is_fp8_param(inside.bias)
        assert not is_fp8_param(te.Linear(32, 16, params_dtype=torch.float64).weight)  # outside


def _fsdp_without_hooks(rank, world):
    del fake_te_fp8.Float8Tensor.fsdp_pre_all_gather  # a TE before 2.10 (this rank's process only)
    with pytest.raises(MegafabError, match="FSDP2 needs Transformer Engine >= 2.10") as error:
        _state(world, fsdp=True)
    return str(error.value)


def test_a_te_without_what_fp8_param_gather_needs_is_one_message(monkeypatch):
    """TE before 2.2 (no cast_master_weights_to_fp8) at the build; before 2.10 (no FSDP2 hooks) under
    FSDP2: one message naming the TE version needed, not a traceback at the first step."""
    fake_te.install(monkeypatch)
    assert "--use-distributed-optimizer instead" in run_ranks(_fsdp_without_hooks, 1, timeout=60)[0]
    import transformer_engine.pytorch.tensor.utils as utils

    monkeypatch.delattr(utils, "cast_master_weights_to_fp8")
    precision = tiny_config(dp=2, use_distributed_optimizer=True, **FP8).precision
    with pytest.raises(MegafabError, match="--fp8-param-gather needs Transformer Engine >= 2.2"):
        quantized_init_context(precision, fp8_recipe)


def test_rules_name_what_fp8_param_gather_needs():
    assert tiny_config(dp=2, use_distributed_optimizer=True, **FP8).precision.fp8_param_gather
    assert tiny_config(dp=2, use_megatron_fsdp=True, **FP8).precision.fp8_param_gather
    cases = {"--fp8-param-gather needs --fp8-format": dict(fp8_format=None, transformer_impl="local"),
             "--fp8-param-gather needs --use-distributed-optimizer or FSDP2": {},
             "--fp8-param-gather with --fp8-recipe mxfp8": dict(use_distributed_optimizer=True,
                                                                fp8_recipe="mxfp8"),
             "--fp8-param-gather with --optimizer-cpu-offload": dict(
                 use_distributed_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)}
    for message, extra in cases.items():
        with pytest.raises(ConfigError, match=message):
            tiny_config(dp=2, **{**FP8, **extra})
