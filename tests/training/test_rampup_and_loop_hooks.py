"""--rampup-batch-size (Megatron's ramp, consumed samples, LR schedule in samples) and the loop's
runtime knobs: --manual-gc, --profile (a torch.profiler trace beside the logs)."""

import gc
import glob
import json
import warnings

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from megafab.training.batch_size import global_batch_size_at, num_micro_batches_at, train_iterations
from megafab.training.loop_hooks import ManualGC, StepProfiler
from tests.helpers.flags import tiny_flags
from tests.helpers.tiny import tiny_config

FLAGS = tiny_flags(num_layers=2) + [
    "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "64"]


@pytest.mark.parametrize("start,incr,samples,gbs,dp", [(16, 16, 5000, 128, 2), (4, 4, 333, 32, 1),
                                                       (8, 24, 100, 56, 4)])
def test_ramp_equals_megatron_core_calculator(start, incr, samples, gbs, dp):
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    cfg = tiny_config(micro_batch_size=2, global_batch_size=gbs, dp=dp, train_iters=None,
                      train_samples=10 * samples, rampup_batch_size=[start, incr, samples])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = RampupBatchsizeNumMicroBatchesCalculator(gbs, 2, dp, False, 0, start, incr, samples)
    for consumed in list(range(0, samples + 2 * gbs, 7)) + [samples, samples + 1]:
        theirs.update(consumed, consistency_check=True)
        assert global_batch_size_at(cfg, consumed) == theirs.get_current_global_batch_size(), consumed
        assert num_micro_batches_at(cfg, consumed) == theirs.get()


def test_ramp_iteration_count_and_rules():
    cfg = tiny_config(micro_batch_size=2, global_batch_size=8, train_iters=None, train_samples=100,
                      rampup_batch_size=[2, 2, 20])
    # 3 increments of 2, one every 20 / 3 samples: batches 2, 2, 2, 2 (consumed 8), 4, 4 (16), 6 -> 22
    # > 20; then (100 - 22) // 8 = 9 full batches, the partial last one dropped (Megatron's count)
    assert [global_batch_size_at(cfg, c) for c in (0, 2, 4, 6, 8, 12, 16, 20, 22)] == \
        [2, 2, 2, 2, 4, 4, 6, 8, 8]
    assert train_iterations(cfg) == 7 + 9
    with pytest.raises(ConfigError) as info:
        config_from_args(FLAGS + ["--train-iters", "10", "--global-batch-size", "10",
                                  "--rampup-batch-size", "3", "2", "100"], world_size=2)
    text = str(info.value)
    assert "--rampup-batch-size needs sample-based training" in text
    assert "--global-batch-size 10 must be START plus a whole number of INCREMENTs" in text
    assert "START 3 is not divisible by --micro-batch-size x data-parallel size = 4" in text


def test_ramp_drives_the_steps_consumed_samples_and_lr(tmp_path, mock_data_cache):
    from tests.helpers.launch import pretrain_in_ranks

    flags = FLAGS + mock_data_cache + ["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12",
                     "--train-samples", "40",
                     "--lr-decay-style", "linear", "--lr-decay-samples", "40", "--log-interval", "1",
                     "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]
    out = pretrain_in_ranks(flags, world_size=1)[0]
    lines = [line for line in out.splitlines() if " iteration " in line and "consumed samples" in line]
    consumed = [int(line.split("consumed samples:")[1].split("|")[0]) for line in lines]
    batches = [int(line.split("global batch size:")[1].split("|")[0]) for line in lines]
    lrs = [float(line.split("learning rate:")[1].split("|")[0]) for line in lines]
    # one increment of 2 every 4 samples: 2, 2, 4 (consumed 8), 6 (14 > 12: full size next), then
    # (40 - 14) // 8 = 3 batches of 8
    assert batches == [2, 2, 4, 6, 8, 8, 8]
    assert consumed == [2, 4, 8, 14, 22, 30, 38]
    assert lrs == pytest.approx([1e-3 * (1 - c / 40) for c in consumed], rel=1e-6)


def test_logging_level_sets_the_root_logger(monkeypatch):
    import logging

    from megafab.training.loop_hooks import setup_logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    setup_logging(10)
    assert root.level == 10 and logging.getLogger("megafab.data").getEffectiveLevel() == 10
    setup_logging(None)  # no flag: untouched
    assert root.level == 10


def test_manual_gc_disables_the_collector_and_collects_on_schedule(monkeypatch):
    cfg = tiny_config(manual_gc=True, manual_gc_interval=3)
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append("x") or 0)
    hooks = ManualGC(cfg.training)
    try:
        assert not gc.isenabled()
        for iteration in range(1, 8):
            hooks.after_step(iteration)
        assert len(collected) == 1 + 2  # at start-up, then after iterations 3 and 6
        with hooks.evaluation():
            pass
        assert len(collected) == 5
    finally:
        hooks.close()
    assert gc.isenabled()
    off = ManualGC(tiny_config(manual_gc=True, manual_gc_interval=0, manual_gc_eval=False).training)
    with off.evaluation():
        off.after_step(3)
    off.close()
    assert len(collected) == 6  # only its start-up collection


def test_profiler_traces_the_requested_steps_beside_the_tensorboard_logs(tmp_path):
    cfg = tiny_config(profile=True, profile_step_start=2, profile_step_end=4, profile_ranks=[0],
                      tensorboard_dir=str(tmp_path / "tb"))
    prof = StepProfiler(cfg, rank=0, device=torch.device("cpu"))
    marks = []
    for iteration in range(6):
        prof.before_step(iteration)
        with torch.profiler.record_function(f"megafab_iteration_{iteration}"):
            torch.randn(8, 8) @ torch.randn(8, 8)
        marks.append(prof.profiler is not None)
    prof.stop()
    assert marks == [False, False, True, True, False, False]
    traces = glob.glob(str(tmp_path / "tb" / "rank0.*.pt.trace.json"))
    assert len(traces) == 1
    names = {e.get("name") for e in json.load(open(traces[0]))["traceEvents"]}
    assert {"megafab_iteration_2", "megafab_iteration_3"} <= names
    assert not names & {"megafab_iteration_1", "megafab_iteration_4"}
    other_rank = StepProfiler(cfg, rank=1, device=torch.device("cpu"))
    other_rank.before_step(2)
    assert other_rank.profiler is None
