"""Moved to megafab.run.launch; these names stay importable from here for arguments.py until the
config package imports them from the run layer."""

from megafab.run.launch import (  # noqa: F401
    LaunchEnv,
    LaunchError,
    pick_device_and_backend,
    planned_world_size,
    read_launch_env,
)
