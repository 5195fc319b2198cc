"""--deterministic-mode as Megatron-LM applies it (megatron/training/determinism.py at HEAD): the
environment NCCL, cuBLAS and Transformer Engine read when they start is checked and completed with
the deterministic values, and torch.use_deterministic_algorithms(True) makes any op without a
deterministic kernel raise instead of running. It must run before the process group and the first
CUDA kernel (pretrain calls it first).

    env_problems(os.environ)   one line per variable set to a value that is not deterministic
    apply(os.environ)          fill the defaults, switch torch to deterministic algorithms
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import torch

DEFAULTS = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
NCCL_ALGOS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")  # Megatron's: Tree's order can vary
EXACT = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",), "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8")}
MUST_START_WITH_1 = ("MAMBA_DETERMINISTIC", "CAUSAL_CONV1D_DETERMINISTIC")


def env_problems(env: Mapping[str, str]) -> list[str]:
    out = []
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGOS for t in tokens):
            out.append(f"--deterministic-mode with NCCL_ALGO={algo!r}: each algorithm must be one of "
                       f"{', '.join(NCCL_ALGOS)} (unset it for Ring)")
    for name, accepted in EXACT.items():
        if env.get(name) is not None and env[name] not in accepted:
            out.append(f"--deterministic-mode with {name}={env[name]!r}: not a deterministic setting; "
                       f"use {' or '.join(accepted)} or unset it")
    for name in MUST_START_WITH_1:
        if env.get(name) and env[name][0] != "1":
            out.append(f"--deterministic-mode with {name}={env[name]!r}: unset it or set it to 1")
    return out


def apply(env: MutableMapping[str, str]) -> None:
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
