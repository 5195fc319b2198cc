import importlib
import json
import pkgutil
import subprocess
import sys
import time

import pytest

import megafab
from megafab.config import ConfigError
from megafab.data.errors import DataError
from megafab.errors import EXIT_USER_ERROR, JobFault, MegafabError, ReportedElsewhere
from megafab.run.report import exit_on_user_error, exit_status, should_print

# The two that end a job on every rank rather than report a user mistake (megafab/errors.py; tested
# below): a job fault exits 3, a rank stopped by another rank's report exits silently.
JOB_LEVEL = {JobFault, ReportedElsewhere}
MESSAGE = "--some-flag 7: must divide 8; pass a divisor of 8"


def _raise(name):
    raise ImportError(f"{name} does not import")


def megafab_errors() -> list[type]:
    """Every subclass of MegafabError (at any depth), with every megafab module imported first."""
    for info in pkgutil.walk_packages(megafab.__path__, "megafab.", onerror=_raise):
        importlib.import_module(info.name)
    found, todo = [], [MegafabError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def test_every_user_error_exits_2_with_one_message(capsys):
    errors = megafab_errors()
    assert JOB_LEVEL | {ConfigError, DataError} <= set(errors) and len(errors) > len(JOB_LEVEL) + 10
    assert JobFault.exit_code == 3 and ReportedElsewhere.silent
    for cls in errors:
        if issubclass(cls, tuple(JOB_LEVEL)):  # a job fault's kinds (a replica drift) keep exit 3
            assert cls.exit_code == 3 or cls.silent, cls
            continue
        error = cls([MESSAGE]) if issubclass(cls, ConfigError) else cls(MESSAGE)
        assert (error.exit_code, error.silent) == (EXIT_USER_ERROR, False), cls
        with pytest.raises(SystemExit) as exit_info, exit_on_user_error(rank=0):
            raise error
        assert exit_info.value.code == 2, cls
        captured = capsys.readouterr()
        assert captured.out == "", cls
        assert captured.err == f"megafab: error: {error}\n" and MESSAGE in captured.err, cls


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
