"""megafab/run/: failures told by type and origin, the optional-package checks, one SIGTERM owner,
no test hooks in production, and benchmarks that run without tests/."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch.distributed as dist

from megafab.arguments import config_from_args
from megafab.run import faults
from megafab.run.packages import missing_package_problems, packages_needed
from tests.helpers.child_hooks import ROOT
from tests.helpers.flags import BASE


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_faults_are_told_by_type_and_origin_not_by_message_text():
    assert faults.is_collective_failure(_raised(dist.DistBackendError("whatever it says")))
    assert faults.is_collective_failure(_raised(dist.DistStoreError("whatever it says")))
    # the words that used to make a fault, raised outside any collective: this rank's own error
    for text in ("DataLoader timed out after 5 seconds", "NCCL error in: ...", "Connection reset by peer",
                 "ProcessGroup c10d gloo"):
        assert not faults.is_collective_failure(_raised(RuntimeError(text))), text


def test_a_failed_wait_on_an_asynchronous_collective_is_a_fault_named_after_it():
    class BrokenWork:
        def wait(self):
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")

    with pytest.raises(faults.CollectiveFailure) as caught:
        faults.wait(BrokenWork(), "gradient reduction (data parallel)")
    assert faults.is_collective_failure(caught.value)
    assert faults.describe_collective(caught.value) == ("an asynchronous gradient reduction (data parallel)",
                                                        None)
    assert faults.describe_reason(caught.value, None) == "a peer closed its connection"


def test_flags_name_the_optional_packages_they_need(tmp_path, monkeypatch):
    cfg = config_from_args(BASE + ["--tensorboard-dir", str(tmp_path), "--wandb-project", "p"], world_size=1)
    assert packages_needed(cfg) == [("--tensorboard-dir", "tensorboard"), ("--wandb-project", "wandb")]
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard raises ImportError
    monkeypatch.setitem(sys.modules, "wandb", None)
    problems = missing_package_problems(cfg)
    assert len(problems) == 2
    assert problems[0].startswith("--tensorboard-dir needs the tensorboard package") and \
        "pip install megafab[tensorboard]" in problems[0]
    assert problems[1].startswith("--wandb-project needs the wandb package") and \
        "pip install megafab[wandb]" in problems[1]
    assert missing_package_problems(config_from_args(BASE, world_size=1)) == []


def _grep(pattern: str, *paths: str) -> list[str]:
    out = subprocess.run(["git", "grep", "-n", "-E", pattern, "--", *paths], cwd=ROOT, capture_output=True,
                         text=True)
    return out.stdout.splitlines()


def test_one_sigterm_owner_and_no_test_hooks_in_megafab():
    assert [line.split(":")[0] for line in _grep(r"signal\.signal\(", "megafab")] == \
        ["megafab/run/signals.py", "megafab/run/signals.py"]
    assert _grep("MEGAFAB_TEST_", "megafab") == []
    assert _grep(r"^\s*(from|import) tests\b", "benchmarks") == []


# Any import of tests/ fails in the benchmark's processes (and in the ranks it forks).
REFUSE_TESTS = """
import sys

class RefuseTests:
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "tests" or fullname.startswith("tests."):
            raise ImportError(f"{fullname}: tests/ is absent for this benchmark run")
        return None

sys.meta_path.insert(0, RefuseTests())
"""


@pytest.mark.timeout(300)
def test_a_benchmark_runs_with_tests_absent(startup_hook):
    env = startup_hook(REFUSE_TESTS)
    refused = subprocess.run([sys.executable, "-c", "import tests.helpers"], cwd=ROOT, env=env,
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "tests/ is absent" in refused.stderr  # the hook works
    out = subprocess.run([sys.executable, "benchmarks/pipeline_bubble.py", "--p", "2", "--m", "2", "--v", "1",
                          "--forward-ms", "1"], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert re.search(r"^1F1B\s+0\s", out.stdout, re.M), out.stdout  # the bubble table's first stage row


def test_no_benchmark_imports_the_tests():
    """Every benchmark, not only the one run above, gets its launcher from megafab.run."""
    import ast
    import pathlib

    importers = []
    for path in sorted(pathlib.Path(ROOT, "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            importers += [f"{path.name}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert importers == []
