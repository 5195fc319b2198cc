"""--ckpt-format fsdp_dtensor (Megatron-FSDP's checkpoint): megafab saves it under Megatron's keys and
resumes it whole at another DP size and in another engine.

FSDP2 (--use-megatron-fsdp) at DP 2 saves; DP 1 FSDP2 and DP 2 plain DDP resume; and back from DP 1
to DP 2; TP 2 (distributed optimizer) -> TP 1 FSDP2; a MoE model's experts (EP 2 -> EP 1, grouped and
sequential names): each continues with the losses of the run that never stopped (float64: 1e-10).
The DCP keys, global shapes and dtypes are the schema of fsdp_dtensor.py's docstring; an async bf16
save holds the fp32 main params under Float16Module's path and FSDP2 reads them back exactly;
--no-strict-fsdp-dtensor-load is Megatron's partial load; what Megatron refuses is refused.
"""

import pytest
import torch

from megafab.checkpoint import checkpointing, dcp_io, directory, formats
from megafab.checkpoint.errors import CheckpointError
from megafab.config import ConfigError
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import assert_losses_close, make_state, moe_state, train, train_save_train
from tests.helpers.tiny import LLAMA_STYLE, tiny_config

MFSDP = dict(dist_opt=False, use_megatron_fsdp=True, ddp_bucket_size=None)
FMT = dict(ckpt_format="fsdp_dtensor")
MOE_FSDP = dict(use_megatron_fsdp=True, ddp_bucket_size=None)


def _straight(rank, world, path, dp):
    state = make_state(tp=1, dp=dp, save=path, style=LLAMA_STYLE, **MFSDP, **FMT)
    return train_save_train(state)


def _resume(rank, world, path, dp, layout):
    state = make_state(tp=1, dp=dp, load=path, style=LLAMA_STYLE, **layout)
    assert checkpointing.load_checkpoint(state) == 2
    assert state.scheduler.num_samples == 2 * 4 and state.consumed_train_samples == 8
    return train(state, 2)


def test_fsdp_dtensor_dp2_resumes_at_dp1_and_in_ddp(tmp_path):
    path = str(tmp_path / "dp2")
    expected = run_ranks(_straight, 2, path, 2, timeout=120)[0]
    assert formats.find_checkpoint(path).format == formats.FSDP_DTENSOR
    assert_losses_close(run_ranks(_resume, 1, path, 1, MFSDP, timeout=120)[0], expected[2:])
    assert_losses_close(run_ranks(_resume, 2, path, 2, dict(dist_opt=False), timeout=120)[0], expected[2:])


def test_fsdp_dtensor_dp1_resumes_at_dp2(tmp_path):
    path = str(tmp_path / "dp1")
    expected = run_ranks(_straight, 1, path, 1, timeout=120)[0]
    assert_losses_close(run_ranks(_resume, 2, path, 2, MFSDP, timeout=120)[0], expected[2:])


def test_the_saved_keys_shapes_and_dtypes_are_megatron_fsdps(tmp_path):
    path = str(tmp_path / "keys")
    run_ranks(_straight, 2, path, 2, timeout=120)
    md = dcp_io.read_metadata(directory.iteration_dir(path, 2)).state_dict_metadata
    layer = "model.module.decoder.layers.1."
    h, f = 32, 64  # the tiny Llama's hidden and (SwiGLU) FFN sizes
    assert tuple(md[layer + "input_layernorm.weight"].size) == (h,)  # the local spec's names
    for half in ("_w", "_v"):  # SwiGLU's fc1 [2f, h] as its gate and up halves
        assert tuple(md[layer + "mlp.linear_fc1.weight" + half].size) == (f, h)
        opt = "optimizer.state.module.module.decoder.layers.1.mlp.linear_fc1.weight" + half
        for kind in ("exp_avg", "exp_avg_sq"):
            assert tuple(md[f"{opt}.{kind}"].size) == (f, h)
            assert md[f"{opt}.{kind}"].properties.dtype == torch.float64
    assert "model.module.decoder.layers.1.mlp.linear_fc1.weight" not in md
    meta = "optimizer.param_to_group_meta.module.module.decoder.layers.1.mlp.linear_fc1.weight"
    assert f"{meta}.lr" in md and not any(k.startswith((meta + "_w", meta + "_v")) for k in md)  # not split
    assert "model.module.embedding.word_embeddings.weight" in md
    for obj in ("args", "iteration", "checkpoint_version", "opt_param_scheduler.num_steps",
                "optimizer.param_to_group_meta.module.module.decoder.layers.0.mlp.linear_fc2.weight.step"):
        assert obj in md and not hasattr(md[obj], "size"), obj
    assert not any(k.startswith(("metadata", "common")) or k.endswith("_extra_state") for k in md)


@pytest.mark.parametrize("overrides, match", [
    (dict(ckpt_format="fsdp_dtensor"), "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp"),
    (dict(ckpt_format="fsdp_dtensor", use_torch_fsdp2=True), "needs --use-megatron-fsdp"),
])
def test_bad_fsdp_dtensor_combinations_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**overrides)


def _dcp_only(tmp_path, shards):
    from megafab.checkpoint.layout import Shard

    path = tmp_path / "iter_0000001"
    dcp_io.save_shards({k: Shard.whole(v) for k, v in shards.items()}, str(path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    return formats.find_checkpoint(str(tmp_path))


def test_dcp_files_alone_are_fsdp_dtensor_and_without_model_weights_are_refused(tmp_path):
    found = _dcp_only(tmp_path / "fsdp", {"model.module.decoder.final_layernorm.weight": torch.ones(32)})
    assert found.format == formats.FSDP_DTENSOR and found.iteration == 1
    # a torch_dist save cut before metadata.json (or Megatron's torch_dcp optimizer alone)
    found = _dcp_only(tmp_path / "cut", {"decoder.final_layernorm.weight": torch.ones(32)})
    assert found.format == formats.FSDP_DTENSOR
    with pytest.raises(CheckpointError, match="DCP files without metadata.json and without `model.` weights"):
        checkpointing.open_source(found, tiny_config().model)


def _moe_straight(rank, world, path, grouped):
    state = moe_state(dp=world, dist_opt=False, ep=2, save=path, moe_grouped_gemm=grouped, **MOE_FSDP, **FMT)
    return train_save_train(state)


def _moe_resume(rank, world, path):
    state = moe_state(dp=world, dist_opt=False, ep=1, load=path)
    assert checkpointing.load_checkpoint(state) == 2
    return train(state, 2)


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_experts_are_saved_per_global_index_and_resume_at_another_ep(tmp_path, grouped):
    path = str(tmp_path / "moe")
    expected = run_ranks(_moe_straight, 2, path, grouped, timeout=120)[0]
    md = dcp_io.read_metadata(directory.iteration_dir(path, 2)).state_dict_metadata
    layer = "decoder.layers.1.mlp."
    for e in range(4):  # global expert indices on both EP ranks: TEGroupedMLP's or SequentialMLP's names
        for half in ("_w", "_v"):
            fc1 = f"{layer}experts.linear_fc1.weight{e}{half}" if grouped else \
                f"{layer}experts.local_experts.{e}.linear_fc1.weight{half}"
            assert tuple(md["model.module." + fc1].size) == (24, 32)
            assert tuple(md[f"optimizer.state.module.module.{fc1}.exp_avg_sq"].size) == (24, 32)
    assert tuple(md[f"model.module.{layer}router.expert_bias"].size) == (4,)
    assert not any(".weight4" in k or "local_experts.4." in k for k in md)
    assert_losses_close(run_ranks(_moe_resume, 1, path, timeout=120)[0], expected[2:])


def _without(path, keys):
    """The checkpoint's DCP metadata without `keys` (a save from a model without them)."""
    import pickle

    md = dcp_io.read_metadata(path)
    for k in keys:
        del md.state_dict_metadata[k]
    with open(f"{path}/.metadata", "wb") as f:
        pickle.dump(md, f)


def _load_outcome(rank, world, path, **flags):
    state = make_state(tp=1, dp=1, load=path, style=LLAMA_STYLE, dist_opt=False, **flags)
    try:
        checkpointing.load_checkpoint(state)
    except CheckpointError as e:
        return str(e)
    [e] = [e for e in state.optimizer.entries if e.name == "decoder.final_layernorm.weight"]
    return state.optimizer.torch_optimizer_of(e).state.get(e.main, {}).get("exp_avg")


def test_no_load_optim_and_no_strict_fsdp_dtensor_load_megatrons_partial_load(tmp_path):
    root = str(tmp_path / "partial")
    run_ranks(_straight, 1, root, 1, timeout=120)
    path, norm = directory.iteration_dir(root, 2), "decoder.final_layernorm.weight"
    assert run_ranks(_load_outcome, 1, root, timeout=120)[0].abs().sum() > 0  # whole: Adam's moment
    assert run_ranks(_load_outcome, 1, root, no_load_optim=True, timeout=120)[0] is None  # fresh
    _without(path, [f"optimizer.state.module.module.{norm}.{k}" for k in ("exp_avg", "exp_avg_sq")])
    strict = run_ranks(_load_outcome, 1, root, timeout=120)[0]  # Megatron's default
    assert f"has no tensor 'optim.{norm}.exp_avg" in strict
    lenient = run_ranks(_load_outcome, 1, root, dist_ckpt_strictness="log_unexpected", timeout=120)[0]
    assert lenient == strict  # Megatron's strict DCP load reads no --dist-ckpt-strictness
    partial = dict(strict_fsdp_dtensor_load=False, timeout=120)
    fresh = run_ranks(_load_outcome, 1, root, **partial)[0]
    assert torch.is_tensor(fresh) and not fresh.any()  # loaded; that parameter's moments start at 0
    _without(path, [f"model.module.{norm}"])
    refused = run_ranks(_load_outcome, 1, root, **partial)[0]
    assert "would keep their initial values" in refused and f"model.{norm}" in refused
    finetuned = run_ranks(_load_outcome, 1, root, finetune=True, **partial)[0]
    assert finetuned is None  # --finetune: the weights it has, a fresh optimizer


def _bf16_async_save(rank, world, path):
    from megafab.checkpoint.async_save import AsyncSaver
    from megafab.distributed.fsdp import local_tensor

    state = make_state(tp=1, dp=2, save=path, dtype=torch.bfloat16, async_save=True,
                       use_persistent_ckpt_worker=True, **MFSDP, **FMT)
    train(state, 2)
    saver = AsyncSaver()
    saver.schedule(state)
    assert saver.maybe_finalize(state.topology, blocking=True)
    saver.close()
    return [(e.name, local_tensor(e.model_param).clone().view(-1)) for e in state.optimizer.entries]


def _bf16_load(rank, world, path):
    state = make_state(tp=1, dp=2, load=path, dtype=torch.bfloat16, **MFSDP)
    assert checkpointing.load_checkpoint(state) == 2
    return [(e.name, e.main.clone()) for e in state.optimizer.entries]


def test_async_bf16_save_stores_fp32_main_params_under_float16modules_path(tmp_path):
    path = str(tmp_path / "bf16")
    saved = run_ranks(_bf16_async_save, 2, path, timeout=120)
    md = dcp_io.read_metadata(directory.iteration_dir(path, 2)).state_dict_metadata
    weights = [k for k in md if k.startswith("model.")]
    # Float16Module's `module.` in the optimizer's names only (its state_dict adds none to the weights');
    # the weights are the fp32 main params, as Megatron-FSDP's
    assert weights and all(k.startswith("model.module.decoder.") or
                           k.startswith("model.module.embedding.") or
                           k.startswith("model.module.output_layer.") for k in weights), weights
    assert all(md[k].properties.dtype == torch.float32 for k in weights)
    assert any(k.startswith("optimizer.state.module.module.module.decoder.") for k in md)
    for before, after in zip(saved, run_ranks(_bf16_load, 2, path, timeout=120)):
        for (name, shard), (name2, main) in zip(before, after):  # FSDP2's fp32 shards read back exactly
            assert name == name2 and torch.equal(shard, main), name


VOCAB = dict(vocab_size=96)  # padded to 96 at TP 1 and TP 2: the same model in both layouts


def _tp2_straight(rank, world, path):
    state = make_state(tp=2, dp=1, save=path, style=LLAMA_STYLE, data_parallel_sharding_strategy="optim",
                       **MFSDP, **FMT, **VOCAB)
    return train_save_train(state)


def _tp1_resume(rank, world, path):
    state = make_state(tp=1, dp=2, load=path, style=LLAMA_STYLE, **MFSDP, **VOCAB)
    assert checkpointing.load_checkpoint(state) == 2
    return train(state, 2)


def test_tp2_distributed_optimizer_save_resumes_at_tp1_fsdp2(tmp_path):
    """Each TP rank writes its [gate_r; up_r] rows of fc1 as rows of the `_w` / `_v` halves."""
    path = str(tmp_path / "tp2")
    expected = run_ranks(_tp2_straight, 2, path, timeout=120)[0]
    assert_losses_close(run_ranks(_tp1_resume, 2, path, timeout=120)[0], expected[2:])


def _pp2_straight(rank, world, path):
    state = make_state(tp=1, dp=1, pp=2, save=path, style=LLAMA_STYLE,
                       data_parallel_sharding_strategy="optim", **MFSDP, **FMT)
    return train_save_train(state)


def test_pp2_save_names_layers_globally_and_resumes_at_pp1(tmp_path):
    """megafab writes global layer numbers (one key per layer of the whole model), whatever the PP split."""
    path = str(tmp_path / "pp2")
    expected = run_ranks(_pp2_straight, 2, path, timeout=120)[-1]  # the last stage's losses
    md = dcp_io.read_metadata(directory.iteration_dir(path, 2)).state_dict_metadata
    assert {int(k.split(".")[4]) for k in md if k.startswith("model.module.decoder.layers.")} == {0, 1, 2, 3}
    assert_losses_close(run_ranks(_resume, 2, path, 2, MFSDP, timeout=120)[0], expected[2:])
