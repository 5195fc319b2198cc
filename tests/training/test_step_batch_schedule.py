"""--step-batch-size-schedule and --eval-micro/global-batch-size as Megatron-LM HEAD runs them: the
parsed schedule, the batch, micro-batches and LR of every step and the sample counts equal HEAD's own
functions (fixtures/megatron_batch_schedule.json, written from Megatron-LM's code by
fixtures/make_megatron_batch_schedule.py) for the gpt3 175B script's schedule; a run resumed in the
middle of the ramp continues exactly; evaluation batches of their own read the same samples as an
equivalent evaluation; each rule is one line."""

import json
import os
import re

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from megafab.config.batch_schedule import parse_step_schedule
from megafab.training.batch_size import (
    batch_problem_at,
    global_batch_size_at,
    num_micro_batches_at,
    train_iterations,
)
from megafab.training.build import build_scheduler
from megafab.training.data_setup import sample_counts
from tests.helpers.flags import BASE, tiny_flags
from tests.helpers.megatron_scripts import GPT3_175B_MAIN, fill, words

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_batch_schedule.json")
HEAD = json.load(open(FIXTURE))
PATHS = {k: f"/nowhere/{k}" for k in ("data", "vocab", "merges", "ckpt", "tb")}
RUNS = {run["name"]: run for run in HEAD["runs"]}
def _samples_dp8_flags() -> list[str]:
    """The fixture's second run as flags: the gpt3 schedule sample-based at TP 8 x PP 16 x DP 8."""
    flags = fill(GPT3_175B_MAIN, PATHS)
    drop = {"--global-batch-size", "--lr-decay-iters", "--lr", "--min-lr", "--lr-decay-style",
            "--train-iters", "--lr-warmup-fraction", "--micro-batch-size", "--eval-interval", "--eval-iters"}
    kept = [t for i, t in enumerate(flags) if t not in drop and (i == 0 or flags[i - 1] not in drop)]
    return kept + words("""--micro-batch-size 2 --train-samples 6000000 --lr 3e-4 --min-lr 3e-5
        --lr-decay-style linear --lr-warmup-fraction 0.0123457 --eval-interval 500 --eval-iters 4
        --eval-global-batch-size 64 --eval-micro-batch-size 4""")


class _Optimizer:
    param_groups = [{}]


@pytest.mark.parametrize("case", HEAD["parse"], ids=lambda c: repr(c["schedule"]))
def test_the_schedule_parses_as_megatron_heads_calculator(case):
    if "parsed" in case:
        assert [list(e) for e in parse_step_schedule(case["schedule"], case["seq_length"])] == case["parsed"]
    else:  # HEAD raises (an assertion or ValueError); megafab's rule says why in one line
        with pytest.raises(ValueError) as info:
            parse_step_schedule(case["schedule"], case["seq_length"])
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("name,flags,world", [
    ("gpt3_175b", fill(GPT3_175B_MAIN, PATHS), 128),
    ("gpt3_schedule_samples_dp8", _samples_dp8_flags(), 1024)])
def test_each_step_equals_megatron_heads_own_functions(name, flags, world):
    """Batch, micro-batches, consumed samples and LR at every recorded iteration (each batch change,
    the step after it, and every 2,500th / 1,000th), the iteration count and the dataset sample
    counts: HEAD's update_train_iters, get_optimizer_param_scheduler, get_train_valid_test_num_samples
    and its calculator."""
    head = RUNS[name]
    cfg = config_from_args(flags + ["--dry-run"], world_size=world)
    assert cfg.training.step_batch_size_schedule == HEAD["schedule"]
    total = train_iterations(cfg)
    assert total == head["train_iters"]
    assert list(sample_counts(cfg, total)) == head["samples"]
    scheduler = build_scheduler(cfg, _Optimizer())
    rows = {row[0]: row for row in head["rows"]}
    consumed, seen = 0, 0
    for iteration in range(1, total + 1):
        batch = global_batch_size_at(cfg, consumed)
        scheduler.step(batch)
        if iteration in rows:
            want = rows[iteration]
            assert [iteration, consumed, batch, num_micro_batches_at(cfg, consumed)] == want[:4]
            assert scheduler.get_lr() == pytest.approx(want[4], rel=1e-12, abs=0)
            seen += 1
        consumed += batch
    assert consumed == head["final_consumed"] and seen == len(rows) > 90


@pytest.mark.parametrize("samples,batch,iterations", HEAD["constant_train_iters"])
def test_train_samples_at_a_constant_batch_last_megatrons_whole_batches(samples, batch, iterations):
    flags = BASE_SAMPLES[:-1] + [str(samples), "--global-batch-size", str(batch)]
    assert train_iterations(config_from_args(flags, world_size=1)) == iterations


def test_the_scripts_split_schedule_is_the_quoted_one():
    flags = fill(GPT3_175B_MAIN, PATHS) + ["--dry-run"]
    at = flags.index("--step-batch-size-schedule")
    quoted = flags[:at + 1] + [" ".join(flags[at + 1:at + 7])] + flags[at + 7:]
    split, joined = config_from_args(flags, world_size=128), config_from_args(quoted, world_size=128)
    schedule = HEAD["schedule"]
    assert split.training.step_batch_size_schedule == joined.training.step_batch_size_schedule == schedule
    equals = config_from_args(flags[:at] + [f"--step-batch-size-schedule={schedule}"] + flags[at + 7:],
                              world_size=128)
    assert equals.training.step_batch_size_schedule == HEAD["schedule"]
    assert split.start_up_notes()[0] == (  # Megatron's start-up log of the schedule, at DP 1
        "step batch size schedule: >= 0 tokens (0 samples) -> batch 16, 16 micro-batches; >= 2,400,000,000 "
        "tokens (1,171,875 samples) -> batch 320, 320 micro-batches; >= 4,800,000,000 tokens (2,343,750 "
        "samples) -> batch 624, 624 micro-batches; >= 7,200,000,000 tokens (3,515,625 samples) -> batch "
        "928, 928 micro-batches; >= 9,600,000,000 tokens (4,687,500 samples) -> batch 1232, 1232 "
        "micro-batches; >= 12,000,000,000 tokens (5,859,375 samples) -> batch 1536, 1536 micro-batches")


def _problems(extra: list[str], world: int = 2, base=None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from_args((base or BASE_SAMPLES) + extra, world_size=world)
    return info.value.problems


BASE_SAMPLES = [t for t in BASE if t not in ("--train-iters", "10")] + ["--train-samples", "100"]
SCHEDULE = ["--step-batch-size-schedule", "0:4 320:8"]  # (seq 32: 8 at 10 samples)


def test_rules_each_one_line():
    flag = "--step-batch-size-schedule '0:4 320:8'"
    assert _problems(SCHEDULE + ["--global-batch-size", "8", "--rampup-batch-size", "4", "4", "100"]) == [
        f"{flag} and --rampup-batch-size are two batch-size ramps; give one (Megatron-LM HEAD ignores "
        f"--rampup-batch-size)"]
    assert _problems(SCHEDULE + ["--global-batch-size", "12"]) == [
        f"--global-batch-size 12 with {flag}: the schedule sets each step's batch (Megatron-LM refuses both "
        f"flags); drop --global-batch-size, or give the schedule's last, 8"]
    assert _problems(SCHEDULE, base=BASE) == [
        f"{flag} with --train-iters: the LR schedule's and the dataset's lengths count iterations of "
        f"--global-batch-size samples, here micro batch x dp = 4, not the schedule's batches; give "
        f"--train-samples (and --lr-*-samples), or --global-batch-size 8"]
    config_from_args(BASE + SCHEDULE + ["--global-batch-size", "8"], world_size=2)  # the script's way
    assert _problems(["--step-batch-size-schedule", "0:8 320:4"]) == [
        "--step-batch-size-schedule '0:8 320:4': batch 4 after 8; the batch may only grow (Megatron asserts "
        "the number of micro-batches never decreases)"]
    later = ["--step-batch-size-schedule", "0:8 320:10"]
    assert _problems(later) == ["--step-batch-size-schedule '0:8 320:10': batch 10 is not divisible by "
                                "--micro-batch-size x data-parallel size = 4; every step is whole "
                                "micro-batches on each rank"]
    assert _problems(["--step-batch-size-schedule", "0:4 3:8"]) == [
        "--step-batch-size-schedule '0:4 3:8': thresholds must strictly increase, got 0 twice (samples of "
        "--seq-length 32 tokens); drop or move one"]
    assert _problems(["--step-batch-size-schedule", "0:4 1Q:8"]) == [
        "--step-batch-size-schedule '0:4 1Q:8': '1Q' is not a number (digits with an optional K, M, B or T "
        "suffix)"]
    assert _problems(["--eval-global-batch-size", "6"]) == [
        "--eval-global-batch-size 6 is not divisible by --eval-micro-batch-size 2 x data-parallel size 2 "
        "= 4; use a multiple of 4"]
    assert _problems(["--eval-micro-batch-size", "0"]) == ["--eval-micro-batch-size 0 must be positive"]
    interleaved = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    assert _problems(SCHEDULE + interleaved, world=4) == [  # micro-batches 1, 2 at micro batch 2 x dp 2
        f"{flag}: with the interleaved schedule every batch's micro-batch count must be a multiple of "
        f"--pipeline-model-parallel-size 2"]
    assert _problems(interleaved + words("--global-batch-size 8 --eval-global-batch-size 4"), world=4) == [
        "the interleaved schedule needs the evaluation's micro-batches (1 = eval global batch / (eval micro "
        "batch x dp)) to be a multiple of --pipeline-model-parallel-size 2"]
    assert _problems(["--eval-micro-batch-size", "3"]) == [
        "--eval-global-batch-size 4 is not divisible by --eval-micro-batch-size 3 x data-parallel size 2 "
        "= 6; use a multiple of 6"]


def test_leading_batches_too_small_for_the_layout_wait_for_the_resumed_count():
    """Megatron checks the batch each step runs: a run resumed with more DP ranks may have left the
    first, smaller batches behind. Without --load they are refused at start-up; with it, the batch
    at the checkpoint's consumed samples is checked after loading."""
    small_first = ["--step-batch-size-schedule", "0:2 320:8"]
    assert _problems(small_first) == ["--step-batch-size-schedule '0:2 320:8': batch 2 is not divisible by "
                                      "--micro-batch-size x data-parallel size = 4; every step is whole "
                                      "micro-batches on each rank"]
    cfg = config_from_args(BASE_SAMPLES + small_first + ["--load", "/nowhere"], world_size=2)
    assert batch_problem_at(cfg, 10) is None and num_micro_batches_at(cfg, 10) == 2
    problem = batch_problem_at(cfg, 9)
    assert problem.problems == ["--step-batch-size-schedule '0:2 320:8': at 9 consumed samples the global "
                                "batch is 2, not divisible by --micro-batch-size x data-parallel size = 4; "
                                "resume with a data-parallel size that divides it"]


RUN = tiny_flags(num_layers=2) + words("""--micro-batch-size 1 --lr 1e-3 --mock-data --vocab-size 64
    --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --lr-decay-style linear""")
ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*?learning rate: (\S+) \|"
                       r" global batch size:\s+(\d+) \| lm loss: (\S+) \|")


def _steps(outputs: list[str]) -> list[tuple]:
    return [m.groups() for out in outputs for m in ITERATION.finditer(out)]


def test_a_run_resumed_in_the_middle_of_the_ramp_continues_exactly(tmp_path, mock_data_cache):
    """Two DP ranks, batches 2, 4, 8 from 0, 6 and 14 samples (96 and 224 tokens of 16): stopped at
    iteration 4 (the second batch) and resumed, the steps equal an uninterrupted run's: consumed
    samples, LR, batch and loss. Megatron's checkpoint where the micro-batch count changes is saved."""
    from tests.helpers.launch import pretrain_in_ranks

    flags = RUN + mock_data_cache + words("""--step-batch-size-schedule 0:2,96:4,224:8 --train-samples 40
        --lr-decay-samples 40 --eval-iters 0""")
    whole = _steps(pretrain_in_ranks(flags, world_size=2))
    # 2, 2, 2 (consumed 6), 4, 4 (14), then 8 until consumed >= 40: 22, 30, 38, 46 (Megatron's count)
    assert [int(s[3]) for s in whole] == [2, 2, 2, 4, 4, 8, 8, 8, 8]
    assert [int(s[1]) for s in whole] == [2, 4, 6, 10, 14, 22, 30, 38, 46]
    ckpt = str(tmp_path / "ckpt")
    first = _steps(pretrain_in_ranks(flags + ["--save", ckpt, "--exit-interval", "4"], world_size=2))
    assert sorted(f for f in os.listdir(ckpt) if f.startswith("iter_")) == ["iter_0000003", "iter_0000004"]
    rest = _steps(pretrain_in_ranks(flags + ["--save", ckpt, "--load", ckpt], world_size=2))
    assert first + rest == whole
    assert len(first) == 4


def test_evaluation_batches_of_their_own(tmp_path, mock_data_cache):
    """--eval-global-batch-size 8 --eval-micro-batch-size 2 on two DP ranks: 2 micro-batches of 2 per
    rank and evaluation step, 16 samples per 2-step evaluation; the validation losses equal 4 steps of
    the training batch (4 samples in micro-batches of 1) over the same 16 samples, at the first
    evaluation, the second (which starts where the first stopped) and the end's validation and test
    (16 test samples); the valid set's size is the same, (iters // interval + 1) x 16 samples; the
    checkpoint after both evaluations counts 2 x 16 consumed validation samples."""
    from tests.helpers.launch import pretrain_in_ranks

    flags = RUN + mock_data_cache + words("--global-batch-size 4 --train-iters 2 --eval-interval 1")
    ckpt = str(tmp_path / "ckpt")
    own = "".join(pretrain_in_ranks(
        flags + words("--eval-iters 2 --eval-global-batch-size 8 --eval-micro-batch-size 2 --save-interval 2")
        + ["--save", ckpt], world_size=2))
    training = "".join(pretrain_in_ranks(flags + words("--eval-iters 4"), world_size=2))

    def validation(out):  # after iterations 1 and 2, at the end (validation, test)
        return [float(v) for v in re.findall(r" loss at [^|]+\| lm loss value: (\S+)", out)]
    assert len(validation(own)) == 4
    assert validation(own) == pytest.approx(validation(training), rel=1e-6)
    assert re.search(r"validation:\s+48\b", own) and re.search(r"validation:\s+48\b", training)
    # Megatron's accounting, which a resumed run reads the validation set from: 2 evaluations x 16
    args = torch.load(os.path.join(ckpt, "iter_0000002", "common.pt"), weights_only=False)["args"]
    assert args.consumed_valid_samples == 32 and args.eval_global_batch_size == 8
