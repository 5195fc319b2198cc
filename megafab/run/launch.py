"""Where this process runs: the launcher's environment (torchrun, or srun's SLURM_* variables), this
process's rank, the device + backend choice and the rendezvous store. The bottom layer: config,
arguments, the planner and the error reporter import it without importing torch.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megafab.errors import MegafabError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


class LaunchError(MegafabError):
    """A launch setting that cannot work on this machine (e.g. NCCL without CUDA)."""


@dataclass
class LaunchEnv:
    """Where this process sits in the job, read from torchrun or SLURM variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def process_rank(env: dict[str, str] | None = None) -> int:
    """This process's global rank from the launcher's environment (0 when launched alone); readable
    before any process group exists."""
    env = os.environ if env is None else env
    for name in ("RANK", "SLURM_PROCID"):
        value = env.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, for a rendezvous (torchrun --master-port, a test job)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"cannot read SLURM node list {nodelist!r}")
    prefix, bracket = m.group(1), m.group(3)
    if bracket is None:
        return prefix
    first = bracket.split(",")[0].split("-")[0]
    return prefix + first


def read_launch_env(env: dict[str, str] | None = None, default_port: int = 29500) -> LaunchEnv:
    """torchrun's RANK/WORLD_SIZE/LOCAL_RANK first; else srun's SLURM_* variables; else 1 process."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"),
                         int(env.get("MASTER_PORT", default_port)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or first_slurm_host(
            env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1")
        # A port derived from the job id lets two jobs share a node without colliding.
        port = env.get("MASTER_PORT")
        if port is None:
            job = env.get("SLURM_JOB_ID", "0")
            port = 10000 + int(job[-4:]) if job[-4:].isdigit() else default_port
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)), addr, int(port), "slurm")
    return LaunchEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"),
                     int(env.get("MASTER_PORT", default_port)), "single")


def planned_world_size(dry_run: bool = False, env: dict[str, str] | None = None) -> int:
    """Processes of this job; a --dry-run may plan for a job it is not part of: WORLD_SIZE alone."""
    env = dict(os.environ if env is None else env)
    launch = read_launch_env(env)
    if dry_run and launch.launcher == "single" and env.get("WORLD_SIZE", "").isdigit():
        return int(env["WORLD_SIZE"])
    return launch.world_size


def device_type(backend: str | None = None) -> str:
    """"cuda" when CUDA is present and --distributed-backend is not gloo, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() and backend != "gloo" else "cpu"


def pick_device_and_backend(local_rank: int, backend: str | None = None) -> tuple[torch.device, str]:
    """cuda:LOCAL_RANK + nccl when CUDA is present, cpu + gloo otherwise; backend overrides."""
    import torch

    if device_type(backend) == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        return device, backend or "nccl"
    if backend == "nccl":
        raise LaunchError("--distributed-backend nccl needs CUDA GPUs, and none is visible; "
                            "use --distributed-backend gloo to run on CPU")
    return torch.device("cpu"), backend or "gloo"


def restart_count(env: dict[str, str] | None = None) -> int:
    """How often torchrun has restarted this job's workers (0 on the first attempt)."""
    value = (os.environ if env is None else env).get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def agent_hosts_store(env: dict[str, str] | None = None) -> bool:
    """True under torchrun: its agent hosts the rendezvous store (else rank 0 does)."""
    return (os.environ if env is None else env).get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def rendezvous_store(launch: LaunchEnv, timeout: datetime.timedelta,
                     env: dict[str, str] | None = None) -> dist.Store:
    """The store init_process_group meets in, its keys scoped to this torchrun restart attempt.

    torchrun's agent keeps one store across restarts; the keys a previous attempt left there (the
    gloo addresses of workers that are gone) made a restarted job wait for them until its timeout.
    Under torchrun the agent hosts the store; otherwise rank 0 does.
    """
    import torch.distributed as dist

    env = dict(os.environ if env is None else env)
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                          is_master=launch.rank == 0 and not agent_hosts_store(env), timeout=timeout,
                          multi_tenant=True)
    return dist.PrefixStore(f"megafab/attempt_{restart_count(env)}", store)
