import json
import subprocess
import sys
import time

import pytest

from megafab.checkpoint import CheckpointError
from megafab.config import ConfigError
from megafab.data.errors import DataError
from megafab.errors import JobFault, MegafabError, ReportedElsewhere
from megafab.run.report import exit_on_user_error, exit_status, should_print


def test_user_errors_share_one_base():
    for cls in (ConfigError, DataError, CheckpointError):
        assert issubclass(cls, MegafabError)


def test_only_rank_zero_prints_an_error_every_rank_sees():
    shared = MegafabError("bad flag")
    local = MegafabError("shard 3 is truncated", every_rank=False)
    assert should_print(shared, rank=0) and not should_print(shared, rank=3)
    assert should_print(local, rank=3)


def test_user_error_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error(rank=0):
        raise DataError("data.idx: truncated; re-run tools/preprocess_data.py")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "megafab: error: data.idx: truncated; re-run tools/preprocess_data.py"


def test_internal_bug_keeps_its_traceback():
    with pytest.raises(KeyError), exit_on_user_error(rank=0):
        raise KeyError("internal")


def test_non_zero_rank_stays_silent_under_torchrun_env():
    code = ("from megafab.errors import MegafabError\nfrom megafab.run.report import exit_on_user_error\n"
            "with exit_on_user_error():\n    raise MegafabError('every rank sees this')\n")
    out = [subprocess.run([sys.executable, "-c", code], env={"RANK": str(r), "PATH": ""},
                          capture_output=True, text=True) for r in (0, 1)]
    assert [o.returncode for o in out] == [2, 2]
    assert "every rank sees this" in out[0].stderr and out[1].stderr == ""


def test_only_the_speaker_writes_torchruns_error_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "speaker.json"))
    monkeypatch.setattr("megafab.run.report.SILENT_EXIT_DELAY_S", 0.0)
    assert exit_status(lambda: (_ for _ in ()).throw(JobFault("rank 3 is gone")), rank=1) == 3
    speaker = json.loads((tmp_path / "speaker.json").read_text())["message"]
    assert speaker["message"] == speaker["extraInfo"]["py_callstack"] == "megafab: error: rank 3 is gone"
    # stamped before any rank torchrun stamps itself when it finds no file (its root cause: the earliest)
    assert int(speaker["extraInfo"]["timestamp"]) < time.time() - 0.5
    assert capsys.readouterr().err == "megafab: error: rank 3 is gone\n"

    for rank, error in ((0, ReportedElsewhere(1, "rank 3 is gone", exit_code=3, reported_at=1000.0)),
                        (2, MegafabError("every rank sees this"))):  # silent; not the speaking rank
        path = tmp_path / f"rank{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        assert exit_status(lambda error=error: (_ for _ in ()).throw(error), rank=rank) == error.exit_code
        assert not path.exists()
        assert capsys.readouterr().err == ""
