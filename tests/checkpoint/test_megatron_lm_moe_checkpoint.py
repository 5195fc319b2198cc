"""A MoE checkpoint written by Megatron-LM core_v0.16.1's own training code, not by megatron-core's
dist_checkpointing.save of a bare model (tests/checkpoint/test_moe_megatron_dist.py): the committed
fixture tests/checkpoint/fixtures/megatron_lm_moe/ (4 experts top-2, a shared expert, alltoall, EP 1,
the distributed optimizer, torch_dist) is what megatron.training.checkpointing.save_checkpoint wrote
after the second of four train_step calls (tests/checkpoint/fixtures/make_megatron_lm_moe.py; its
README.md says how it was made).

- megafab.inference.load_model gives megatron-core's recorded logits within 1e-5;
- pretrain_gpt.py --load <a copy> --finetune with the fixture's own Megatron flags trains from it at
  EP 1, EP 2, TP 2 and TP 2 x EP 2 (forked ranks, a second or two each): every rank exits 0, the first
  lm loss is the loaded model's loss on that first batch (1e-5), iterations and samples restart at 0;
- resuming it (no --finetune) reads Megatron-LM's default (dp_reshardable, bucket buffers)
  distributed-optimizer state: iterations 3 and 4 log Megatron-LM's own losses (1e-5); with
  --no-load-optim iteration 3 does, iteration 4 does not;
- --mock-data gives the batches Megatron-LM's loader gave that run;
- the same run saved with --dist-ckpt-optim-fully-reshardable (fixtures/megatron_lm_moe_fully_reshardable)
  resumes with its optimizer at DP 1, DP 2 and EP 2: iterations 3 and 4 log Megatron-LM's own losses.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megafab.checkpoint.megatron_dist import read_common
from megafab.inference.load import load_model
from megafab.run.fork_ranks import run_ranks
from tests.helpers.launch import losses
from tests.helpers.main_ranks import main_stdout

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_lm_moe"
SAVED = FIXTURE / "iter_0000002"
REFERENCE = torch.load(FIXTURE / "reference.pt", weights_only=True)
# What a user passes again to resume the fixture's run (model and training flags, not the generator's
# CPU ones); --train-iters and the batch split are the fine-tuning run's.
FLAGS = REFERENCE["model_flags"] + REFERENCE["train_flags"]


def _with(flags: list[str], **values) -> list[str]:
    """`flags` with each --NAME VALUE of `values` (name_with_underscores=value) replaced or added."""
    out = list(flags)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = str(value)
        else:
            out += [flag, str(value)]
    return out


def test_the_fixture_is_a_megatron_lm_moe_checkpoint_with_its_optimizer():
    from torch.distributed.checkpoint import FileSystemReader

    sizes = {k: getattr(v, "size", None) for k, v in
             FileSystemReader(str(SAVED)).read_metadata().state_dict_metadata.items()}
    # [layers, experts, ...]: SequentialMLP's experts under their global index, every layer MoE
    assert sizes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == torch.Size([2, 4, 2 * 16, 64])
    assert sizes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == torch.Size([2, 4, 64, 16])
    assert sizes["decoder.layers.mlp.router.weight"] == torch.Size([2, 4, 64])
    assert sizes["decoder.layers.mlp.shared_experts.linear_fc1.weight"] == torch.Size([2, 2 * 16, 64])
    assert not any("local_experts" in k or ("linear_fc1.weight" in k and "mlp.experts" not in k
                                            and "shared" not in k) for k in sizes)  # no dense MLP
    assert any(k.startswith("optimizer.") for k in sizes)  # Megatron-LM saved its optimizer state
    common = read_common(str(SAVED))  # megafab's reader: Megatron's classes stand in, none imported
    args = common["args"]
    assert (common["iteration"], args.num_experts, args.moe_router_topk, args.moe_token_dispatcher_type,
            args.moe_shared_expert_intermediate_size, args.expert_model_parallel_size,
            args.use_distributed_optimizer, args.ckpt_format) == \
        (2, 4, 2, "alltoall", 16, 1, True, "torch_dist")
    assert "optimizer" in common and "opt_param_scheduler" in common


def _loss(model, tokens, labels, loss_mask=None) -> float:
    """Megatron's lm loss: the loss-mask-weighted mean per-token cross entropy, float32."""
    with torch.no_grad():
        logits = model(tokens).transpose(0, 1).float()  # [b, s, V]
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    mask = torch.ones_like(per_token) if loss_mask is None else loss_mask.flatten().float()
    return ((per_token * mask).sum() / mask.sum()).item()


def test_load_model_gives_megatron_cores_logits_and_loss():
    model, cfg = load_model(str(FIXTURE))
    assert (cfg.moe.num_experts, cfg.moe.moe_router_topk, cfg.moe.moe_shared_expert_intermediate_size) \
        == (4, 2, 16)
    with torch.no_grad():
        logits = model(REFERENCE["tokens"]).transpose(0, 1)
    assert logits.shape == REFERENCE["logits"].shape == (2, 32, 128)
    err = (logits - REFERENCE["logits"]).abs().max().item()
    assert err < 1e-5, err
    print(f"MEASURED logits max abs err {err!r}, loss err "
          f"{abs(_loss(model, REFERENCE['tokens'], REFERENCE['labels']) - REFERENCE['loss'].item())!r}")
    assert REFERENCE["logits"].std() > 0.3  # logits of a trained-from-std-0.05 model, not ~0
    assert abs(_loss(model, REFERENCE["tokens"], REFERENCE["labels"]) - REFERENCE["loss"].item()) < 1e-5


def _mock_batches(rank, world, flags, n) -> list[dict]:
    """A run's first `n` global batches (megafab's mock-data iterator, one data-parallel rank)."""
    from megafab.arguments import config_from_args
    from megafab.training.data_setup import build_data_iterators

    cfg = config_from_args(flags, world_size=1, start_up=True)
    one_rank = SimpleNamespace(rank=0, dp_rank=0, dp=1)
    train, _, _ = build_data_iterators(cfg, one_rank, consumed_train_samples=0)
    return [next(train) for _ in range(n)]


def _recorded_batch_loss(i: int) -> float:
    """The fixture's model (megafab.inference) on the i-th batch Megatron-LM's loader gave its run
    (test_mock_data_batches_are_megatron_lms: megafab's mock data gives the same)."""
    model, _ = load_model(str(FIXTURE))
    batch = REFERENCE["batches"][i]
    return _loss(model, batch["tokens"], batch["labels"], batch["loss_mask"])


@pytest.fixture(scope="module")
def finetune_flags(mock_data_cache):
    return _with(FLAGS + mock_data_cache, train_iters=3, log_interval=1, micro_batch_size=2,
                 global_batch_size=2)


@pytest.fixture(scope="module")
def first_batch_loss():
    assert REFERENCE["batches"][0]["tokens"].shape == (2, 32)  # one global batch of the fine-tuning run
    return _recorded_batch_loss(0)


# At TP 2 Megatron pads the vocabulary to a multiple of 128 * 2 = 256: the user halves the divisor to
# keep the checkpoint's 128 rows (Megatron-LM's own --load needs the same).
TP2 = {"tensor_model_parallel_size": 2, "make_vocab_size_divisible_by": 64}


@pytest.mark.parametrize("world, layout", [
    (1, {}),
    (2, {"expert_model_parallel_size": 2, "micro_batch_size": 1}),  # 2 experts a rank, DP 2
    (2, TP2),  # every expert split over expert-TP 2
    (4, {**TP2, "expert_model_parallel_size": 2, "micro_batch_size": 1}),
], ids=["ep1", "ep2", "tp2", "tp2_ep2"])
def test_pretrain_finetunes_from_the_megatron_lm_checkpoint(tmp_path, finetune_flags, first_batch_loss, world,
                                                            layout):
    load, save = tmp_path / "load", tmp_path / "save"
    shutil.copytree(FIXTURE, load)  # --finetune must not need to write to it; a copy all the same
    flags = _with(finetune_flags, load=load, save=save, save_interval=3, **layout) + ["--finetune"]
    if "tensor_model_parallel_size" in layout:
        flags.append("--sequence-parallel")  # Megatron trains MoE under TP only with it
    out = main_stdout(world, flags, tmp_path / "run")  # asserts every rank exits 0
    assert "finetune: weights only, starting at iteration 0" in out
    logged = losses(out)
    assert sorted(logged) == [1, 2, 3]  # iteration 1/3 on: the checkpoint's iteration 2 is not kept
    assert abs(logged[1] - first_batch_loss) < 1e-5, (logged[1], first_batch_loss)
    print(f"MEASURED world {world}: logged {logged[1]!r} loaded model {first_batch_loss!r}")
    assert " consumed samples:            2 |" in out  # and its consumed samples neither
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert os.path.isdir(save / "iter_0000003")


def test_resuming_megatron_lms_default_save_reads_its_bucket_optimizer_state(tmp_path, mock_data_cache):
    """Megatron-LM's default distributed-optimizer save (dp_reshardable) keeps Adam's state only in
    flat bucket buffers (optimizer.distributed.*), which megafab lays out and reads: iterations 3 and
    4 log Megatron-LM's own losses; --no-load-optim (a fresh Adam) logs iteration 3 alike (the same
    weights), iteration 4 not."""
    load = tmp_path / "load"
    shutil.copytree(FIXTURE, load)
    flags = _with(FLAGS + mock_data_cache, load=load, log_interval=1)  # the fixture's own 4-iteration run
    logged = {}
    for run, extra in (("resumed", []), ("fresh", ["--no-load-optim"])):
        out = main_stdout(1, flags + extra, tmp_path / run)
        assert "holds no optimizer state" not in out
        assert " consumed samples:            6 |" in out  # the iteration and samples are the checkpoint's
        logged[run] = losses(out)
        assert sorted(logged[run]) == [3, 4]
        assert abs(logged[run][3] - _recorded_batch_loss(2)) < 1e-5  # the batch after 2 x 2 samples
    for it in (3, 4):
        assert abs(logged["resumed"][it] - REFERENCE["lm_losses"][it - 1]) < 1e-5, (it, logged, REFERENCE)
    assert abs(logged["fresh"][4] - REFERENCE["lm_losses"][3]) > 1e-3, logged
    print(f"MEASURED resumed {logged['resumed']} fresh Adam {logged['fresh']} Megatron-LM "
          f"{REFERENCE['lm_losses'][2:]}")


def test_mock_data_batches_are_megatron_lms(mock_data_cache):
    """--mock-data gives the batches Megatron-LM's loader gave the fixture's run (megatron-core splits
    the mock documents 1,1,1 whatever --split says)."""
    recorded = REFERENCE["batches"]
    [ours] = run_ranks(_mock_batches, 1, FLAGS + mock_data_cache, len(recorded), timeout=240)
    for i, (batch, theirs) in enumerate(zip(ours, recorded)):
        for key, value in theirs.items():
            assert torch.equal(batch[key], value.to(batch[key].dtype)), (i, key)


FULLY_RESHARDABLE = FIXTURE.parent / "megatron_lm_moe_fully_reshardable"


@pytest.mark.parametrize("world, layout", [
    (1, {}),
    (2, {"micro_batch_size": 1}),  # DP 2: the distributed optimizer's state resharded over two ranks
    (2, {"expert_model_parallel_size": 2, "micro_batch_size": 1}),
], ids=["dp1", "dp2", "ep2"])
def test_resuming_megatron_lms_fully_reshardable_save_logs_megatron_lms_next_losses(
        tmp_path, mock_data_cache, world, layout):
    """The same Megatron-LM run saved with --dist-ckpt-optim-fully-reshardable (Adam's moments shaped
    like the parameters) resumes in megafab with its optimizer: iteration 3 (the saved weights) and
    iteration 4 (after a step with the loaded moments, step count and schedule) log Megatron-LM's own
    lm losses within 1e-5."""
    reference = torch.load(FULLY_RESHARDABLE / "reference.pt", weights_only=True)
    assert reference["save_flags"] == ["--dist-ckpt-optim-fully-reshardable"]
    assert reference["lm_losses"] == REFERENCE["lm_losses"]  # one run, two optimizer formats
    assert read_common(str(FULLY_RESHARDABLE / "iter_0000002"))["optimizer"]["param_state_sharding_type"] \
        == "fully_reshardable"
    load = tmp_path / "load"
    shutil.copytree(FULLY_RESHARDABLE, load)
    flags = _with(FLAGS + mock_data_cache, load=load, log_interval=1, **layout)
    out = main_stdout(world, flags, tmp_path / "run")
    assert "optimizer starts fresh" not in out
    logged = losses(out)
    assert sorted(logged) == [3, 4]
    for it in (3, 4):  # (a fresh Adam, --no-load-optim, logs iteration 4 3.8e-2 off)
        megatron_lm = reference["lm_losses"][it - 1]
        assert abs(logged[it] - megatron_lm) < 1e-5, (layout, it, logged[it], megatron_lm)
    print(f"MEASURED full resume {layout}: megafab {logged} Megatron-LM {reference['lm_losses'][2:]}")
