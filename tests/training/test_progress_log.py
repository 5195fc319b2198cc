"""--log-progress: SAVE/progress.txt as Megatron writes it (rank 0, tab-separated fields at Megatron's
positions, read back by the port of get_start_time_from_progress_log), sync and async, with
--save-retain-interval's deletions; the FLOPs so far counted per iteration from the planner's FLOPs
(megafab.plan.flops, each iteration's own batch under a ramp), kept in torch_dist and fsdp_dtensor
checkpoints across resumes (and --finetune, as Megatron), and read from a Megatron-LM checkpoint."""

from __future__ import annotations

import os
import shutil
from datetime import datetime
from pathlib import Path

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.checkpoint import checkpointing, dcp_io, safe_pickle
from megafab.checkpoint.directory import iteration_dir
from megafab.checkpoint.megatron_dist import TorchDistSource
from megafab.plan.flops import flops_per_iteration
from megafab.run.fork_ranks import run_ranks
from megafab.training.batch_size import global_batch_size_at
from megafab.training.progress_log import FILE, TIME_FORMAT, start_from_progress_log
from tests.helpers.checkpoint import make_state, train_save_train
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny import LLAMA_STYLE
from tests.helpers.tiny_corpus import TINY, write_corpus

FIXTURES = Path(__file__).parent.parent / "checkpoint" / "fixtures"
FLOPS = "num_floating_point_operations_so_far"


def _flags(corpus, save, iters, *extra):
    return TINY + ["--train-iters", str(iters), "--lr-decay-iters", "6", "--data-path", corpus, "--split",
                   "90,5,5", "--global-batch-size", "2", "--save", save, "--save-interval", "2",
                   "--log-progress", *extra]


def _expected_flops(flags, world, iters) -> float:
    """The planner's FLOPs of each iteration's own global batch, summed."""
    cfg = config_from_args(flags, world_size=world)
    total, consumed = 0.0, 0
    for _ in range(iters):
        gbs = global_batch_size_at(cfg, consumed)
        total, consumed = total + flops_per_iteration(cfg, gbs), consumed + gbs
    return total


def _lines(save) -> list[list[str]]:
    with open(os.path.join(save, FILE)) as f:
        return [line.rstrip("\n").split("\t") for line in f]


def _saved_flops(save, iteration) -> float:
    common = torch.load(os.path.join(save, f"iter_{iteration:07d}", "common.pt"), weights_only=False)
    return common[FLOPS]


def _check_prefix(tokens, world, job_id):
    datetime.strptime(tokens[0], TIME_FORMAT)
    assert tokens[1] == f"Job ID: {job_id}" and tokens[2] == f"# GPUs: {world}"


def _check_saved(tokens, event, iteration, flops, tokens_billions):
    assert tokens[3] == event and tokens[4] == f"Iteration: {iteration}"
    assert tokens[5].startswith("Job throughput: ") and tokens[5].endswith(" TFLOP/s/GPU")
    assert tokens[6].startswith("Cumulative throughput: ") and tokens[6].endswith(" TFLOP/s/GPU")
    assert float(tokens[5].split(": ")[1].split()[0]) >= 0 and float(tokens[6].split(": ")[1].split()[0]) >= 0
    assert tokens[7] == f"Floating-point operations: {flops:.2e}"
    assert tokens[8] == f"Tokens (in billions): {tokens_billions:.2f}"


def test_progress_lines_and_flops_so_far_across_a_resume(tmp_path, monkeypatch):
    corpus, save = write_corpus(str(tmp_path / "corpus")), str(tmp_path / "save")
    first = _flags(corpus, save, 4)
    result = run_ranks_main(2, first, tmp_path / "log1", env={"SLURM_JOB_ID": "4242"}, timeout=120)
    assert result.codes == [0, 0], result.describe()
    per_two = _expected_flops(first, 2, 2)
    assert _saved_flops(save, 2) == per_two and _saved_flops(save, 4) == _expected_flops(first, 2, 4)
    lines = _lines(save)
    assert [t[3] for t in lines] == ["Starting job", "Saved checkpoint", "Saved checkpoint"]
    for t in lines:
        _check_prefix(t, 2, "4242")
    _check_saved(lines[1], "Saved checkpoint", 2, per_two, 4 * 32 / 1e9)
    _check_saved(lines[2], "Saved checkpoint", 4, 2 * per_two, 8 * 32 / 1e9)

    second = _flags(corpus, save, 6, "--load", save)  # resumes at 4, appends; no SLURM job: an empty ID
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # the forked ranks inherit it
    result = run_ranks_main(2, second, tmp_path / "log2", timeout=120)
    assert result.codes == [0, 0], result.describe()
    total = _expected_flops(second, 2, 6)
    assert _saved_flops(save, 6) == total and total == 3 * per_two
    lines = _lines(save)
    assert [t[3] for t in lines] == ["Starting job", "Saved checkpoint", "Saved checkpoint",
                                     "Starting job", "Saved checkpoint"]
    _check_prefix(lines[3], 2, "")
    _check_saved(lines[4], "Saved checkpoint", 6, total, 12 * 32 / 1e9)
    # Megatron's reading: the first job of this world size, from no FLOPs
    started, started_flops = start_from_progress_log(os.path.join(save, FILE), 2)
    assert started == datetime.strptime(lines[0][0], TIME_FORMAT) and started_flops == 0


def test_finetune_keeps_the_checkpoints_count_as_megatron(tmp_path):
    corpus, save = write_corpus(str(tmp_path / "corpus")), str(tmp_path / "save")
    tuned = str(tmp_path / "tuned")
    result = run_ranks_main(1, _flags(corpus, save, 2), tmp_path / "log1", timeout=120)
    assert result.codes == [0], result.describe()
    flags = _flags(corpus, tuned, 2, "--load", save, "--finetune")
    result = run_ranks_main(1, flags, tmp_path / "log2", timeout=120)
    assert result.codes == [0], result.describe()
    per_two = _expected_flops(flags, 1, 2)
    assert _saved_flops(save, 2) == per_two and _saved_flops(tuned, 2) == 2 * per_two
    assert _lines(tuned)[-1][7] == f"Floating-point operations: {2 * per_two:.2e}"


def test_async_saves_write_saving_then_saved(tmp_path):
    corpus, save = write_corpus(str(tmp_path / "corpus")), str(tmp_path / "save")
    flags = _flags(corpus, save, 4, "--async-save", "--use-persistent-ckpt-worker")
    result = run_ranks_main(1, flags, tmp_path / "log", timeout=120)
    assert result.codes == [0], result.describe()
    lines = _lines(save)
    assert [t[3] for t in lines] == ["Starting job", "Saving async checkpoint", "Saved async checkpoint",
                                     "Saving async checkpoint", "Saved async checkpoint"]
    per_two = _expected_flops(flags, 1, 2)
    _check_saved(lines[1], "Saving async checkpoint", 2, per_two, 4 * 32 / 1e9)
    _check_saved(lines[3], "Saving async checkpoint", 4, 2 * per_two, 8 * 32 / 1e9)
    assert lines[2][3:] == ["Saved async checkpoint", "Iteration: 2"]
    assert lines[4][3:] == ["Saved async checkpoint", "Iteration: 4"]
    assert _saved_flops(save, 4) == 2 * per_two


@pytest.mark.parametrize("extra,saved", [([], ["Saved checkpoint"]),
                                         (["--async-save", "--use-persistent-ckpt-worker"],
                                          ["Saving async checkpoint", "Saved async checkpoint"])],
                         ids=["sync", "async"])
def test_save_retain_interval_deletions_are_logged(extra, saved, tmp_path):
    """Megatron: sync, the deletion comes with the save (before its line); async, after the save is
    finalized ("Saved async checkpoint")."""
    corpus, save = write_corpus(str(tmp_path / "corpus")), str(tmp_path / "save")
    flags = _flags(corpus, save, 6, "--save-retain-interval", "4", *extra)
    result = run_ranks_main(1, flags, tmp_path / "log", timeout=120)
    assert result.codes == [0], result.describe()
    events = [" ".join(t[3:5]) if t[3] != "Starting job" else t[3] for t in _lines(save)]
    at = {it: [f"{e} Iteration: {it}" for e in saved] for it in (2, 4, 6)}
    if extra:  # iteration 2 is deleted once 4 is finalized; 4 is kept (a multiple of 4), 6 is the latest
        assert events == ["Starting job", *at[2], *at[4], "Deleted checkpoint Iteration: 2", *at[6]]
    else:
        assert events == ["Starting job", *at[2], "Deleted checkpoint Iteration: 2", *at[4], *at[6]]
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000004", "iter_0000006"]


def test_a_batch_size_ramp_counts_each_iterations_own_batch(tmp_path):
    corpus, save = write_corpus(str(tmp_path / "corpus")), str(tmp_path / "save")
    flags = TINY + ["--train-samples", "6", "--lr-decay-samples", "6", "--rampup-batch-size", "1", "1", "2",
                    "--global-batch-size", "2", "--data-path", corpus, "--split", "90,5,5", "--save", save,
                    "--save-interval", "100", "--log-progress"]
    result = run_ranks_main(1, flags, tmp_path / "log", timeout=120)
    assert result.codes == [0], result.describe()
    cfg = config_from_args(flags, world_size=1)
    batches, consumed = [], 0
    while consumed < 6:
        batches.append(global_batch_size_at(cfg, consumed))
        consumed += batches[-1]
    assert 1 in batches and 2 in batches  # the ramp's first iterations ran smaller batches
    latest = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    assert latest == len(batches)
    assert _saved_flops(save, latest) == sum(flops_per_iteration(cfg, b) for b in batches)


def _fsdp_dtensor_save_and_resume(rank, world, path):
    state = make_state(tp=1, dp=1, save=path, style=LLAMA_STYLE, dist_opt=False, use_megatron_fsdp=True,
                       ddp_bucket_size=None, ckpt_format="fsdp_dtensor")
    train_save_train(state, after=0)
    resumed = make_state(tp=1, dp=1, load=path, style=LLAMA_STYLE, dist_opt=False, use_megatron_fsdp=True,
                         ddp_bucket_size=None)
    checkpointing.load_checkpoint(resumed)
    return state.num_floating_point_operations_so_far, resumed.num_floating_point_operations_so_far, \
        flops_per_iteration(state.cfg, state.cfg.training.global_batch_size)


def test_fsdp_dtensor_saves_and_restores_the_count(tmp_path):
    """Megatron-FSDP's format keeps it as a byte object of its own (written as 0 before)."""
    path = str(tmp_path / "fsdp")
    counted, restored, per_iteration = run_ranks(_fsdp_dtensor_save_and_resume, 1, path, timeout=120)[0]
    assert counted == 2 * per_iteration > 0 and restored == counted
    stored = dcp_io.read_objects(iteration_dir(path, 2), [FLOPS])[FLOPS]
    assert safe_pickle.loads(stored, "test") == counted


def _line(when, world, text):
    return f"{when}\tJob ID: 7\t# GPUs: {world}\t{text}\n"


def _saved(event, iteration, flops):
    return (f"{event}\tIteration: {iteration}\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 "
            f"TFLOP/s/GPU\tFloating-point operations: {flops:.2e}\tTokens (in billions): 0.00")


def test_start_is_the_first_job_since_the_world_size_changed_and_counts_committed_saves(tmp_path):
    path = tmp_path / FILE
    path.write_text(
        _line("2026-01-01 00:00:00", 8, "Starting job")
        + _line("2026-01-01 01:00:00", 8, _saved("Saved checkpoint", 10, 1e15))
        + _line("2026-01-02 00:00:00", 4, "Starting job")  # a new world size: the count restarts here
        + _line("2026-01-02 01:00:00", 4, _saved("Saving async checkpoint", 20, 2e15))
        + _line("2026-01-02 02:00:00", 4, "Starting job")  # the async save never committed
        + _line("2026-01-03 00:00:00", 4, _saved("Saving async checkpoint", 30, 3e15))
        + _line("2026-01-03 00:10:00", 4, "Saved async checkpoint\tIteration: 30"))
    assert start_from_progress_log(str(path), 4) == (datetime(2026, 1, 2), 1e15)
    with open(path, "a") as f:  # back at 8: the count starts from the committed async save
        f.write(_line("2026-01-04 00:00:00", 8, "Starting job"))
    assert start_from_progress_log(str(path), 8) == (datetime(2026, 1, 4), 3e15)


def test_flops_so_far_read_from_a_megatron_lm_checkpoint(tmp_path):
    copy = tmp_path / "iter_0000002"
    shutil.copytree(FIXTURES / "megatron_lm_dp2" / "iter_0000002", copy)
    common = torch.load(copy / "common.pt", weights_only=False)
    common[FLOPS] = 1.25e15
    torch.save(common, copy / "common.pt")
    assert TorchDistSource(str(copy)).counters.num_floating_point_operations_so_far == 1.25e15
