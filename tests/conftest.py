"""Fixtures every test directory may use; shared helper code lives in tests/helpers/."""

import pytest

from tests.helpers.child_hooks import startup_hook_env


@pytest.fixture
def startup_hook(tmp_path):
    """startup_hook(code) -> an environment whose Python processes run `code` at start-up."""
    return lambda code, env=None: startup_hook_env(tmp_path / "startup_hook", code, env)


@pytest.fixture(scope="session")
def mock_data_cache(tmp_path_factory) -> list[str]:
    """--data-cache-path flags for --mock-data runs: the sample indices of the 100,000 mock documents
    (seconds per rank at short sequences) are built once per size and split by one rank for the whole
    session, then memory-mapped by every other rank and run (the same arrays either way)."""
    return ["--data-cache-path", str(tmp_path_factory.mktemp("mock_data_cache"))]
