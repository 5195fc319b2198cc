"""megafab-estimate: the evaluated layout, the search's JSON, and every printed candidate starts."""

import json

import pytest

from megafab.cli.estimate import main
from megafab.plan.machines import machine
from megafab.plan.planner import plan
from megafab.plan.report import dry_run_prediction
from megafab.plan.search import search
from tests.helpers.launch import pretrain_in_ranks

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "127", "--make-vocab-size-divisible-by", "32", "--global-batch-size", "8"]
TRAIN = ["--mock-data", "--num-workers", "0", "--lr", "1e-3", "--train-iters", "2", "--log-interval", "1",
         "--eval-iters", "0"]
KEYS = {"flags", "tp", "pp", "vpp", "cp", "ep", "dp", "micro_batch_size", "recompute", "sharding",
        "memory_gib", "step_time_s", "tflops_per_gpu", "mfu"}


def test_evaluate_prints_the_prediction_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    flags = MODEL + ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert main(flags + ["--num-gpus", "4", "--gpu", "a100-sxm-80gb", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted on a100-sxm-80gb:" in text and "TFLOP/s per device" in text
    evaluated = json.loads(out.read_text())["evaluated"]
    assert KEYS <= set(evaluated)
    assert (evaluated["tp"], evaluated["dp"], evaluated["micro_batch_size"]) == (2, 2, 2)
    assert evaluated["step_time_s"] > 0 and 0 < evaluated["mfu"] < 1


def test_search_json_has_one_object_per_candidate_best_first(tmp_path, capsys):
    out = tmp_path / "search.json"
    argv = MODEL + ["--micro-batch-size", "1", "--num-gpus", "8", "--gpu", "h100-sxm-80gb", "--search",
                    "--top", "5", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    cands = data["candidates"]
    assert 1 <= len(cands) <= 5 and all(KEYS <= set(c) for c in cands)
    times = [c["step_time_s"] for c in cands]
    assert times == sorted(times)
    assert all(c["tp"] * c["pp"] * c["cp"] * c["dp"] == 8 for c in cands)
    assert len({(c["tp"], c["pp"], c["cp"], c["dp"]) for c in cands}) == len(cands)
    assert data["evaluated"]["tp"] == 1 and data["evaluated"]["dp"] == 8  # the flags' own layout
    assert "--search: 8 devices" in capsys.readouterr().out


def test_search_without_a_machine_is_one_user_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(MODEL + ["--micro-batch-size", "1", "--num-gpus", "4", "--search"])
    assert exc.value.code == 2
    assert "--gpu" in capsys.readouterr().err


def test_profile_to_an_unwritable_path_is_one_user_error_before_measuring(tmp_path, capsys):
    for path in (tmp_path / "missing" / "here.json", tmp_path):  # no such folder; a folder
        with pytest.raises(SystemExit) as exc:
            main(["--profile", str(path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--profile" in err and "Traceback" not in err


def test_dry_run_prediction_replaces_the_fixed_mfu_guess():
    from megafab.arguments import config_from_args

    cfg = config_from_args(MODEL + ["--micro-batch-size", "1", "--dry-run"], world_size=1)
    line = dry_run_prediction(cfg, plan(cfg), machine("h100-sxm-80gb"))
    assert line.startswith("  predicted on h100-sxm-80gb:") and "MFU" in line


@pytest.mark.slow
def test_top_3_of_a_world_4_search_each_train_two_iterations():
    result = search(MODEL + TRAIN, 4, machine("h100-sxm-80gb"), top=3)
    assert len(result.ranked) == 3
    for cand in result.ranked:
        outputs = pretrain_in_ranks(cand.flags, world_size=4, timeout=240)
        done = any(" iteration        2/       2 |" in out for out in outputs)
        assert done, (cand.flags, outputs[-1][-2000:])
