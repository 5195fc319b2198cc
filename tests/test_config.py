import subprocess
import sys

import pytest
import torch.distributed as dist

from megafab.arguments import config_from_args
from megafab.config import ConfigError, pad_vocab_size, swiglu_ffn_size
from tests.helpers.flags import BASE, tiny_flags


def test_megatron_derived_defaults():
    cfg = config_from_args(BASE + ["--tensor-model-parallel-size", "2",
                                   "--pipeline-model-parallel-size", "2"], world_size=8)
    assert cfg.model.ffn_hidden_size == 256
    assert cfg.model.kv_channels == 8
    assert cfg.model.num_query_groups == 8
    assert cfg.model.max_position_embeddings == 32
    assert cfg.parallel.data_parallel_size == 2
    assert cfg.training.global_batch_size == 4 and cfg.training.num_micro_batches == 1
    assert cfg.model.padded_vocab_size == 1024  # multiple of 128 * tp=2 = 256
    assert cfg.optimizer.lr_decay_iters == 10
    assert cfg.parallel.ddp_bucket_size == 40_000_000


def test_swiglu_ffn_and_vocab_padding_formulas():
    assert swiglu_ffn_size(4096) == 10880  # Megatron's rounding (Llama rounds to 11008)
    assert swiglu_ffn_size(64) == 128
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 8) == 51200
    cfg = config_from_args(BASE + ["--swiglu"], world_size=1)
    assert cfg.model.ffn_hidden_size == swiglu_ffn_size(64)


def test_virtual_pipeline_derivation_and_gradient_accumulation():
    cfg = config_from_args(BASE + ["--pipeline-model-parallel-size", "2",
                                   "--num-layers-per-virtual-pipeline-stage", "1",
                                   "--global-batch-size", "8"], world_size=2)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    assert cfg.training.num_micro_batches == 4


def test_sequence_parallel_at_tp1_is_turned_off_with_a_note():
    cfg = config_from_args(BASE + ["--sequence-parallel"], world_size=1)
    assert cfg.parallel.sequence_parallel is False
    assert any("sequence-parallel has no effect" in line for line in cfg.start_up_notes())


def test_save_interval_without_save_runs_with_a_note():
    """Megatron's functional tests pass it (their --save commented out); Megatron saves nothing."""
    cfg = config_from_args(BASE + ["--save-interval", "5"], world_size=1)
    assert any("--save-interval 5 without --save: nothing is saved" in line for line in cfg.start_up_notes())


def test_three_mistakes_one_error_listing_all_before_any_process_group():
    argv = BASE + ["--tensor-model-parallel-size", "3", "--fp16", "--bf16",
                   "--global-batch-size", "5"]
    with pytest.raises(ConfigError) as info:
        config_from_args(argv, world_size=6)
    problems = info.value.problems
    assert not dist.is_initialized()
    text = str(info.value)
    assert "--num-attention-heads 8 is not divisible by --tensor-model-parallel-size 3" in text
    assert "--fp16 and --bf16 were both given" in text
    assert "--global-batch-size 5 is not divisible by --micro-batch-size 2 x data-parallel size 2" in text
    assert len(problems) == 3, problems


def test_world_size_layers_gqa_and_seq_length_violations_are_all_reported():
    argv = tiny_flags(num_layers=5, hidden_size=64, num_attention_heads=8, seq_length=64) + [
        "--group-query-attention", "--num-query-groups", "3", "--max-position-embeddings", "32",
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1", "--mock-data", "--vocab-size", "10",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    with pytest.raises(ConfigError) as info:
        config_from_args(argv, world_size=6)
    text = str(info.value)
    for expected in ("world size 6 is not divisible", "--num-layers 5 is not divisible",
                     "--num-query-groups 3 is not divisible by --tensor-model-parallel-size 2",
                     "--num-attention-heads 8 is not divisible by --num-query-groups 3",
                     "--seq-length 64 exceeds --max-position-embeddings 32"):
        assert expected in text


def test_unsupported_megatron_flag_is_refused_by_name():
    with pytest.raises(ConfigError, match="--moe-use-upcycling: refused, upcycling a dense checkpoint into "
                                          "an MoE model is not implemented in megafab yet"):
        config_from_args(BASE + ["--moe-use-upcycling"], world_size=1)
    with pytest.raises(ConfigError, match="--num-distributed-optimizer-instances"):
        config_from_args(BASE + ["--num-distributed-optimizer-instances", "2"], world_size=1)
    # the value meaning "off" is accepted
    config_from_args(BASE + ["--num-distributed-optimizer-instances", "1"], world_size=1)


def test_abbreviations_are_not_accepted():
    with pytest.raises(ConfigError, match="--hidden: unrecognized flag"):
        config_from_args(BASE + ["--hidden", "64"], world_size=1)


def test_missing_tokenizer_files_are_named(tmp_path):
    """Files are start-up checks (megafab/checks/probes.py), not rules: the entry point asks for them."""
    argv = [a for a in BASE if a not in ("--mock-data",)]
    argv = argv + ["--data-path", str(tmp_path / "corpus_text_document"),
                   "--tokenizer-type", "SentencePieceTokenizer",
                   "--tokenizer-model", str(tmp_path / "nope.model")]
    config_from_args(argv, world_size=1)  # the pure rules: nothing wrong
    with pytest.raises(ConfigError) as info:
        config_from_args(argv, world_size=1, start_up=True)
    assert "nope.model: no such file" in str(info.value)
    assert "corpus_text_document.idx not found" in str(info.value)


def test_entry_point_prints_one_message_and_exits_2():
    proc = subprocess.run([sys.executable, "pretrain_gpt.py",
                           *tiny_flags(num_layers=3, hidden_size=64, num_attention_heads=8),
                           "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"],
                          capture_output=True, text=True, timeout=120,
                          env={"WORLD_SIZE": "2", "RANK": "0", "PATH": ""})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--num-layers 3 is not divisible" in proc.stderr
    assert "--lr is required" in proc.stderr


def test_help_works_without_torch_distributed():
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    assert "--tensor-model-parallel-size" in proc.stdout


def test_warmup_not_shorter_than_decay_is_a_config_error_not_a_traceback():
    expected = r"warmup \(40 samples\) is not shorter than the decay \(20 samples"
    with pytest.raises(ConfigError, match=expected):
        config_from_args(BASE + ["--lr-warmup-iters", "20", "--global-batch-size", "2"], world_size=1)


def test_dry_run_without_a_vocabulary_says_what_to_give():
    argv = [a for a in BASE if a not in ("--vocab-size", "1000", "--mock-data")] + ["--dry-run"]
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], capture_output=True, text=True,
                          timeout=120, env={"PATH": ""})
    assert proc.returncode == 2 and "--dry-run needs the vocabulary size" in proc.stderr


def test_new_flag_rules_are_reported_together_in_one_message():
    argv = BASE + ["--reset-attention-mask", "--no-create-attention-mask-in-dataloader",
                   "--decoupled-min-lr", "1e-5", "--grad-reduce-in-bf16", "--swiglu", "--squared-relu",
                   "--tokenizer-special-tokens", "<unk>", "--attention-backend", "fast",
                   "--profile", "--profile-step-start", "5", "--profile-step-end", "5",
                   "--profile-ranks", "0", "7"]
    with pytest.raises(ConfigError) as info:
        config_from_args(argv, world_size=2)
    text = str(info.value)
    for expected in ("--reset-attention-mask needs the attention mask the data loader builds",
                     "--decoupled-min-lr needs --decoupled-lr",
                     "--grad-reduce-in-bf16 needs --bf16",
                     "--swiglu and --squared-relu each choose the MLP activation",
                     "--tokenizer-special-tokens is implemented for --tokenizer-type TikTokenizer only",
                     "--attention-backend: invalid choice: 'fast'",
                     "--profile-step-start 5 must be before --profile-step-end 5",
                     "--profile-ranks 7: not a rank of this 2-process job"):
        assert expected in text, expected
    assert len(info.value.problems) == 8, info.value.problems


def test_megatron_semantics_of_new_flags():
    cfg = config_from_args(BASE + ["--bf16", "--grad-reduce-in-bf16", "--no-check-for-nan-in-loss-and-grad",
                                   "--fp8-format", "hybrid"], world_size=1)
    assert cfg.parallel.accumulate_allreduce_grads_in_fp32 is False  # Megatron's rule
    assert cfg.training.check_for_nan_in_loss_and_grad is False
    assert cfg.model.transformer_impl == "transformer_engine"  # FP8 exists only in TE's layers
    assert config_from_args(BASE, world_size=1).training.check_for_nan_in_loss_and_grad is True
    notes = config_from_args(BASE + ["--use-mcore-models", "--adam-beta2", "0.95", "--optimizer", "sgd"],
                             world_size=1).start_up_notes()
    assert len([n for n in notes if n.startswith("accepted, no effect in megafab:")]) == 1
    assert "--use-mcore-models (" in notes[-1]
    assert "--adam-beta2 (--optimizer sgd keeps no Adam moments)" in notes[-1]
