"""Megatron-LM's default distributed-optimizer checkpoint (`dp_reshardable`: Adam's state in its DDP
buckets' flat buffers) resumed whole (megafab/checkpoint/megatron_dp_reshardable.py):

- the committed MoE run saved both ways by Megatron-LM (fixtures/megatron_lm_moe, dp_reshardable, and
  megatron_lm_moe_fully_reshardable, parameter-shaped): every optimizer tensor read from the buckets
  equals the parameter-shaped one, and Adam's step too;
- every saved main param read from the buckets is its weight (fp32 runs), for the three fixtures;
- fixtures/megatron_lm_dp2: a dense run Megatron-LM saved at DP 2 with five buckets (--overlap-grad-reduce,
  --ddp-bucket-size 12000; biases, GQA, tied embeddings) resumes at DP 2, DP 1 and TP 2, and
  fixtures/megatron_lm_moe_ep2 (the MoE model at EP 2: experts in a second, chained optimizer) at EP 2,
  EP 1 and EP 1 x DP 2, fixtures/megatron_lm_tp2_pp2 (TP 2 x PP 2 x 2 virtual stages, tied embeddings)
  as saved and on one process: iterations 3, 4, 5 log Megatron-LM's own continuation within 1e-6
  (fp32, exact values from --metrics-jsonl); with --no-load-optim (a fresh Adam) they differ;
- a layout megafab derives that is not the saved one (another bucket size, another module order) is
  refused, not read as shifted values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.megatron_dist import TorchDistSource, read_common
from megafab.checkpoint.megatron_dp_reshardable import MCORE_LAYER_ORDER, DpReshardable
from megafab.model.activations import gated_linear_unit
from tests.helpers.launch import losses
from tests.helpers.main_ranks import main_stdout, run_ranks_main

FIXTURES = Path(__file__).parent / "fixtures"
DP2, MOE_EP2, TP2_PP2 = (FIXTURES / f"megatron_lm_{name}" for name in ("dp2", "moe_ep2", "tp2_pp2"))
REFERENCE = torch.load(DP2 / "reference.pt", weights_only=True)
FLAGS = REFERENCE["model_flags"] + REFERENCE["train_flags"]
BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_"


def test_buckets_read_as_the_same_runs_fully_reshardable_save():
    buckets = TorchDistSource(str(FIXTURES / "megatron_lm_moe" / "iter_0000002"))
    shaped = TorchDistSource(str(FIXTURES / "megatron_lm_moe_fully_reshardable" / "iter_0000002"))
    assert read_common(buckets.path)["optimizer"]["param_state_sharding_type"] == "dp_reshardable"
    assert buckets.optimizer_problem is None and buckets.step == shaped.step == 2.0
    ours, theirs = buckets.read_all("optim."), shaped.read_all("optim.")
    assert set(ours) == set(theirs) and any(".mlp.experts." in k for k in ours)  # routed experts too
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    assert all(ours[k].abs().sum() > 0 for k in ours if k.endswith(".exp_avg_sq"))


def test_the_dp2_fixture_is_megatron_lms_bucketed_dp2_save():
    common = read_common(str(DP2 / "iter_0000002"))
    args = common["args"]
    assert (args.data_parallel_size, args.use_distributed_optimizer, args.overlap_grad_reduce,
            args.ddp_bucket_size, args.add_bias_linear, args.untie_embeddings_and_output_weights) == \
        (2, True, True, 12000, True, False)
    assert common["optimizer"]["param_state_sharding_type"] == "dp_reshardable"
    source = TorchDistSource(str(DP2 / "iter_0000002"))
    sizes = [source.buckets.sizes[BUCKET + str(b)] for b in range(5)]
    assert sizes == [(24960,), (12672,), (24960,), (12672,), (8256,)]  # 8256: padded to 8320 for DP 2
    assert len(REFERENCE["lm_losses"]) == 5 and REFERENCE["save_at"] == 2


@pytest.mark.parametrize("fixture", ["megatron_lm_moe", "megatron_lm_dp2", "megatron_lm_moe_ep2",
                                     "megatron_lm_tp2_pp2"])
def test_every_main_param_read_from_the_buckets_is_its_weight(fixture):
    """An fp32 run's main params are its weights: each parameter's `param` range of the buckets holds
    exactly its saved weights where megafab lays it out (every kind shares those offsets); the EP 2 save
    keeps its routed experts in a second, chained optimizer's buffers (dp_group_idx per EP rank)."""
    source = TorchDistSource(str(FIXTURES / fixture / "iter_0000002"))
    weights, optim = source.read_all("model."), source.read_all("optim.")
    mains = [k[len("optim."):-len(".main_param")] for k in optim if k.endswith(".main_param")]
    assert len(mains) == len([k for k in weights if "optimizer" not in k and "expert_bias" not in k])
    for name in mains:
        assert torch.equal(optim[f"optim.{name}.main_param"], weights[f"model.{name}"]), name
    chained = {b[0] for b in source.buckets.buckets}
    assert chained == ({0, 1} if fixture.endswith("ep2") else {0}), chained
    if fixture.endswith("pp2"):  # TP 2 x PP 2: four model-parallel ranks, two virtual stages each
        assert {b[1:3] for b in source.buckets.buckets} == {(g, c) for g in range(4) for c in range(2)}


def _lay_out_again(args: dict):
    from torch.distributed.checkpoint import FileSystemReader

    path = str(DP2 / "iter_0000002")
    source = TorchDistSource(path)
    saved = {**vars(read_common(path)["args"]), **args}
    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    model = source.model_cfg
    return DpReshardable(path, stored, source.stored, saved, model, gated_linear_unit(model))


@pytest.mark.parametrize("args", [{"ddp_bucket_size": 20000}, {"transformer_impl": "transformer_engine"}],
                         ids=["bucket_size", "te_module_order"])
def test_bucket_sizes_other_than_the_saved_ones_are_refused(args):
    with pytest.raises(CheckpointError, match="lays out the dp_reshardable buckets .* checkpoint stores"):
        _lay_out_again(args)


def test_parameters_placed_off_the_saved_pieces_are_refused(monkeypatch):
    """linear_qkv's bias before its weight: the same bucket sizes, other offsets."""
    order = list(MCORE_LAYER_ORDER["local"])
    i = order.index("self_attention.linear_qkv.weight")
    order[i:i + 2] = order[i + 1], order[i]
    monkeypatch.setitem(MCORE_LAYER_ORDER, "local", tuple(order))
    with pytest.raises(CheckpointError, match="does not fall on the stored pieces"):
        _lay_out_again({})


def test_a_run_resuming_buckets_it_cannot_lay_out_is_refused_and_no_load_optim_resumes(tmp_path,
                                                                                      mock_data_cache):
    """common.pt's args edited to another --ddp-bucket-size: the resume stops with the problem named
    (exit 2), not with shifted moments; --no-load-optim loads the weights and counters."""
    load = tmp_path / "load"
    shutil.copytree(DP2, load)
    common_pt = load / "iter_0000002" / "common.pt"
    common = torch.load(common_pt, weights_only=False)  # Megatron-LM's own file, written here
    common["args"].ddp_bucket_size = 20000
    torch.save(common, common_pt)
    flags = FLAGS + mock_data_cache + ["--load", str(load), "--log-interval", "1"]
    refused = run_ranks_main(1, flags, tmp_path / "refused")
    said = refused.all_err() + refused.out[0]
    assert refused.codes == [2] and "lays out the dp_reshardable buckets" in said, refused.describe()
    assert "--no-load-optim" in said
    assert sorted(losses(main_stdout(1, flags + ["--no-load-optim"], tmp_path / "fresh"))) == [3, 4, 5]


def _metric_losses(file: Path) -> dict[int, float]:
    """The exact lm losses of --metrics-jsonl (the log line rounds to 7 digits)."""
    lines = [json.loads(line) for line in file.read_text().splitlines()]
    return {r["iteration"]: r["lm loss"] for r in lines if r.get("kind") == "iteration"}


def _resume(tmp_path, mock_data_cache, world: int, extra: list, fixture: Path = DP2,
            switches: tuple = ()) -> dict[int, float]:
    """The fixture's run resumed with its flags, but the layout flags `extra` names (one value each)
    replaced by extra's (None: dropped), and `switches` added."""
    load = tmp_path / "load"
    shutil.copytree(fixture, load)
    metrics = tmp_path / "metrics.jsonl"
    reference = torch.load(fixture / "reference.pt", weights_only=True)
    flags = reference["model_flags"] + reference["train_flags"]
    for name in extra[::2]:
        while name in flags:
            del flags[flags.index(name):flags.index(name) + 2]
    extra = [x for flag, value in zip(extra[::2], extra[1::2]) if value is not None for x in (flag, value)]
    flags = flags + mock_data_cache + [
        "--load", str(load), "--log-interval", "1", "--metrics-jsonl", str(metrics)] + extra + list(switches)
    out = main_stdout(world, flags, tmp_path / "run")
    assert "loaded checkpoint from" in out and "optimizer starts fresh" not in out
    assert " consumed samples:           12 |" in out  # iteration 3 of the saved run's counters
    return _metric_losses(metrics)


EP1 = ["--expert-model-parallel-size", "1"]
# One rank of the TP 2 x PP 2 save: Megatron pads its vocabulary to 128 x TP = 256 rows, which the
# loss's softmax sees; keep them
ONE = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
       "--num-virtual-stages-per-pipeline-rank", None, "--make-vocab-size-divisible-by", "256"]


@pytest.mark.parametrize("fixture, world, extra", [
    (DP2, 2, []),  # the saved DP 2
    (DP2, 1, []),  # DP 1: two micro-batches of 2
    (DP2, 2, ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]),  # keeps 128 rows
    (MOE_EP2, 2, []),  # the saved EP 2 (dense DP 2, expert DP 1)
    (MOE_EP2, 1, EP1),  # every expert on one rank
    (MOE_EP2, 2, EP1),  # experts data-parallel over 2
    (TP2_PP2, 4, []),  # the saved TP 2 x PP 2 x 2 virtual stages
    (TP2_PP2, 1, ONE),  # one process
], ids=["dp2", "dp1", "tp2", "moe_ep2", "moe_ep1_dp1", "moe_ep1_dp2", "tp2_pp2_vpp2", "tp2_pp2_to_one"])
def test_resuming_megatron_lms_dp_reshardable_save_continues_as_megatron_lm(tmp_path, mock_data_cache,
                                                                              fixture, world, extra):
    logged = _resume(tmp_path, mock_data_cache, world, extra, fixture)
    megatron_lm = torch.load(fixture / "reference.pt", weights_only=True)["lm_losses"]
    assert sorted(logged) == [3, 4, 5]
    for it in (3, 4, 5):
        assert abs(logged[it] - megatron_lm[it - 1]) < 1e-6, (extra, it, logged[it], megatron_lm[it - 1])
    print(f"MEASURED {fixture.name} world {world} {extra}: megafab {[logged[i] for i in (3, 4, 5)]} "
          f"Megatron-LM {megatron_lm[2:]}")


def test_a_fresh_adam_does_not_continue_megatron_lms_run(tmp_path, mock_data_cache):
    logged = _resume(tmp_path, mock_data_cache, 2, [], switches=("--no-load-optim",))
    megatron_lm = REFERENCE["lm_losses"]
    assert abs(logged[3] - megatron_lm[2]) < 1e-6  # the same weights: the same first loss
    off = [abs(logged[it] - megatron_lm[it - 1]) for it in (4, 5)]
    assert min(off) > 1e-3, off  # the steps after differ: the moments and step count matter
    print(f"MEASURED --no-load-optim: megafab {[logged[i] for i in (3, 4, 5)]} off by {off}")
