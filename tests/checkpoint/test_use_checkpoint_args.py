"""--use-checkpoint-args (Megatron-LM's load_args_from_checkpoint): the model arguments the checkpoint
in --load records override the command line's before the config is derived and checked.

- the Megatron-LM MoE fixture (tests/checkpoint/fixtures/megatron_lm_moe) given only the flags
  Megatron's list leaves to the command line builds the config its full flags build, and resumes
  logging Megatron-LM's own losses; a start-up note lists what the checkpoint set;
- a megafab-saved checkpoint likewise (the same config as its flags, and a resumed run);
- the parallel sizes only with --use-mp-args-from-checkpoint-args (the TP 2 x PP 2 x VPP 2 fixture);
  the tokenizer unless --no-use-tokenizer-model-from-checkpoint-args (or its --disable- spelling);
- no --load, or an unreadable checkpoint: one problem line each, exit 2; a --load without a checkpoint
  or one without args leaves the command line's arguments (Megatron's fallback), in a note -- and in
  the error when they make no model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megafab.arguments import config_from_args
from megafab.config import ConfigError
from tests.helpers.launch import losses
from tests.helpers.main_ranks import main_stdout

FIXTURES = Path(__file__).parent / "fixtures"
MOE = FIXTURES / "megatron_lm_moe"
REFERENCE = torch.load(MOE / "reference.pt", weights_only=True)
# The fixture's model flags Megatron's list does not take from a checkpoint (QK-norm, the
# NullTokenizer's --vocab-size, the initialisation, the layer implementation, the aux loss; the
# dispatcher, whose default is not None, so the command line's always stands).
NOT_IN_CHECKPOINT_ARGS = ["--qk-layernorm", "--vocab-size", "127", "--make-vocab-size-divisible-by", "128",
                          "--init-method-std", "0.05", "--transformer-impl", "local", "--moe-aux-loss-coeff",
                          "1e-2", "--moe-token-dispatcher-type", "alltoall"]
USE = ["--use-checkpoint-args"]


def _model(cfg):
    return cfg.model, cfg.moe


def test_the_megatron_lm_checkpoint_builds_the_model_its_flags_build():
    flags = REFERENCE["model_flags"] + REFERENCE["train_flags"]
    rest = REFERENCE["train_flags"] + NOT_IN_CHECKPOINT_ARGS
    expected = config_from_args(flags + ["--load", str(MOE)], world_size=1)
    cfg = config_from_args(rest + USE + ["--load", str(MOE)], world_size=1)
    assert _model(cfg) == _model(expected)
    assert cfg.moe.num_experts == 4 and cfg.model.hidden_size == 64  # not the defaults
    note = next(n for n in cfg.start_up_notes() if n.startswith("--use-checkpoint-args: from "))
    for part in ("--num-layers 2", "--hidden-size 64", "--num-experts 4", "--moe-ffn-hidden-size 16",
                 "--add-bias-linear False", "--padded-vocab-size 128", "--tokenizer-type 'NullTokenizer'"):
        assert part in note, (part, note)
    with pytest.raises(ConfigError, match="--num-layers is required"):  # without it, the sizes are missing
        config_from_args(rest + ["--load", str(MOE)], world_size=1)


def test_the_checkpoint_overrides_the_command_lines_forced_arguments_but_not_its_sizes():
    rest = REFERENCE["train_flags"] + NOT_IN_CHECKPOINT_ARGS
    cfg = config_from_args(rest + USE + ["--load", str(MOE), "--num-layers", "4", "--num-experts", "8",
                                         "--normalization", "LayerNorm"], world_size=1)
    # Megatron: num_layers is set from the checkpoint only when the command line leaves it None;
    # num_experts and normalization always
    assert (cfg.model.num_layers, cfg.moe.num_experts, cfg.model.normalization) == (4, 4, "RMSNorm")


def test_resuming_the_megatron_lm_checkpoint_with_its_args_logs_its_losses(tmp_path, mock_data_cache):
    load = tmp_path / "load"
    shutil.copytree(MOE, load)
    flags = REFERENCE["train_flags"] + NOT_IN_CHECKPOINT_ARGS + mock_data_cache + USE + \
        ["--load", str(load), "--log-interval", "1"]
    out = main_stdout(1, flags, tmp_path / "run")
    assert "--use-checkpoint-args: from " in out
    logged = losses(out)
    assert sorted(logged) == [3, 4]
    for it in (3, 4):
        assert abs(logged[it] - REFERENCE["lm_losses"][it - 1]) < 1e-5, (it, logged, REFERENCE["lm_losses"])
    print(f"MEASURED resumed {logged} Megatron-LM {REFERENCE['lm_losses'][2:]}")


# A model that differs from every default the list covers (GQA, RoPE, SwiGLU, untied, no biases).
MEGAFAB_MODEL = ["--num-layers", "3", "--hidden-size", "48", "--ffn-hidden-size", "96",
                 "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                 "--seq-length", "16",
                 "--max-position-embeddings", "16", "--position-embedding-type", "rope", "--normalization",
                 "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--hidden-dropout", "0", "--attention-dropout", "0"]
MEGAFAB_TRAIN = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--micro-batch-size", "2",
                 "--global-batch-size", "2", "--lr", "1e-3", "--mock-data", "--num-workers", "0",
                 "--eval-iters", "0", "--log-interval", "1", "--transformer-impl", "local",
                 "--lr-decay-iters", "4"]


@pytest.mark.parametrize("saved_as", [[], ["--ckpt-format", "torch", "--no-save-optim"]],
                         ids=["torch_dist", "legacy_torch"])
def test_a_megafab_saved_checkpoint_gives_its_model_and_resumes(tmp_path, mock_data_cache, saved_as):
    save = tmp_path / "save"
    saving = ["--train-iters", "2", "--save", str(save), "--save-interval", "2"] + saved_as
    first = main_stdout(1, MEGAFAB_MODEL + MEGAFAB_TRAIN + mock_data_cache + saving, tmp_path / "first")
    assert sorted(losses(first)) == [1, 2]
    load = ["--load", str(save), "--train-iters", "3"] + (["--no-load-optim"] if saved_as else [])
    expected = config_from_args(MEGAFAB_MODEL + MEGAFAB_TRAIN + load, world_size=1)
    cfg = config_from_args(MEGAFAB_TRAIN + USE + load, world_size=1)
    assert _model(cfg) == _model(expected)
    logged = {}
    for run, flags in (("flags", MEGAFAB_MODEL), ("checkpoint_args", USE)):
        out = main_stdout(1, MEGAFAB_TRAIN + mock_data_cache + flags + load, tmp_path / run)
        logged[run] = losses(out)
    assert sorted(logged["checkpoint_args"]) == [3]  # resumed at the checkpoint's iteration
    assert logged["checkpoint_args"] == logged["flags"]  # the same model, weights and batch


def test_the_parallel_sizes_only_with_use_mp_args_from_checkpoint_args():
    tp2_pp2 = FIXTURES / "megatron_lm_tp2_pp2"
    rest = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "5", "--lr", "1e-2",
            "--mock-data", "--qk-layernorm", "--vocab-size", "127", "--transformer-impl", "local",
            "--load", str(tp2_pp2)] + USE
    plain = config_from_args(rest, world_size=4)
    assert (plain.parallel.tensor_model_parallel_size, plain.parallel.pipeline_model_parallel_size) == (1, 1)
    assert plain.model.num_layers == 4 and plain.model.hidden_size == 32
    mp = config_from_args(rest + ["--use-mp-args-from-checkpoint-args"], world_size=4)
    p = mp.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (2, 2, 1)
    # the checkpoint's virtual_pipeline_model_parallel_size 2 is set, then Megatron's validate_args derives
    # it again from --num-virtual-stages-per-pipeline-rank, which the list does not carry: none
    assert p.virtual_pipeline_model_parallel_size is None
    note = next(n for n in mp.start_up_notes() if n.startswith("--use-checkpoint-args: from "))
    assert "--tensor-model-parallel-size 2" in note and "--pipeline-model-parallel-size 2" in note


@pytest.mark.parametrize("off", ["--no-use-tokenizer-model-from-checkpoint-args",
                                 "--disable-use-tokenizer-model-from-checkpoint-args"])
def test_the_tokenizer_comes_from_the_checkpoint_unless_disabled(off):
    rest = REFERENCE["train_flags"] + NOT_IN_CHECKPOINT_ARGS + USE + ["--load", str(MOE)]
    rest += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "vocab.json", "--merge-file",
             "merges.txt"]
    assert config_from_args(rest, world_size=1).data.tokenizer_type == "NullTokenizer"
    assert config_from_args(rest + [off], world_size=1).data.tokenizer_type == "GPT2BPETokenizer"


def _problems(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from_args(REFERENCE["train_flags"] + NOT_IN_CHECKPOINT_ARGS + argv, world_size=1)
    return [p for p in info.value.problems if p.startswith("--use-checkpoint-args")]


def test_without_a_checkpoint_to_read_the_command_lines_arguments_stand_or_one_line_says_why(tmp_path):
    assert _problems(USE) == ["--use-checkpoint-args: it reads the model arguments from the checkpoint in "
                              "--load (or --pretrained-checkpoint), and neither is given; pass --load DIR"]
    [line] = _problems(USE + ["--load", str(MOE), "--non-persistent-ckpt-type", "local"])
    assert line.startswith("--use-checkpoint-args: not with --non-persistent-ckpt-type local")
    # Megatron's fallback: no checkpoint in --load (a first run that will save there), or one without
    # args: the command line's model arguments; a note, and a line of the error when they make no model
    (tmp_path / "empty").mkdir()
    bare = tmp_path / "bare"
    shutil.copytree(MOE, bare)
    torch.save({"iteration": 2, "checkpoint_version": 3.0}, bare / "iter_0000002" / "common.pt")  # no args
    no_tracker = "holds no checkpoint (latest_checkpointed_iteration.txt not found)"
    for load, why in ((tmp_path / "empty", no_tracker), (bare, "records no model arguments")):
        expected = f"--use-checkpoint-args: --load {load} {why}"
        [line] = _problems(USE + ["--load", str(load)])
        assert line.startswith(expected) and line.endswith("so the command line's model arguments stand, "
                                                           "as in Megatron"), line
        flags = REFERENCE["model_flags"] + REFERENCE["train_flags"] + USE + ["--load", str(load)]
        cfg = config_from_args(flags, world_size=1)
        assert cfg.moe.num_experts == 4 and any(n.startswith(expected) for n in cfg.start_up_notes())
    damaged = tmp_path / "damaged"
    shutil.copytree(MOE, damaged)
    (damaged / "iter_0000002" / "metadata.json").write_text("{")
    [line] = _problems(USE + ["--load", str(damaged)])
    assert line.startswith(f"--use-checkpoint-args with --load {damaged}: ") and "metadata.json" in line


def test_the_entry_point_exits_2_with_the_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as info:
        pretrain_gpt.main(MEGAFAB_TRAIN + USE + ["--load", str(tmp_path), "--train-iters", "1", "--dry-run"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megafab: error:") and "--num-layers is required" in err
    assert f"--use-checkpoint-args: --load {tmp_path} holds no checkpoint" in err
    assert "Traceback" not in err
