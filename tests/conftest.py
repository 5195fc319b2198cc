"""Fixtures every test directory may use; shared helper code lives in tests/helpers/."""

import pytest

from tests.helpers.child_hooks import startup_hook_env


@pytest.fixture
def startup_hook(tmp_path):
    """startup_hook(code) -> an environment whose Python processes run `code` at start-up."""
    return lambda code, env=None: startup_hook_env(tmp_path / "startup_hook", code, env)
