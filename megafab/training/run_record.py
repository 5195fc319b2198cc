"""The record a run leaves: the start-up summary (world layout, resolved arguments, parameters per
pipeline stage, dataset sizes), the resolved configuration as a file, and Megatron's memory line.

    using world size: 8, data-parallel size: 2, tensor-model-parallel size: 2, ...
    ------------------------ arguments ------------------------
      accumulate_allreduce_grads_in_fp32 .............. True
    ...
     > number of parameters on (tensor, pipeline) model parallel rank (0, 1): 1234567
    [Rank 3] (after 1 iterations) memory (MB) | allocated: ... | max allocated: ... | reserved: ...
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch
import torch.distributed as dist

import megafab
from megafab.arguments import build_parser
from megafab.config import SECTIONS
from megafab.config_file import resolved_config_toml

RESOLVED_CONFIG = "resolved_config.toml"
MB = 1024.0 * 1024.0


def world_layout_line(topo, cfg) -> str:
    p = cfg.parallel
    return (f"using world size: {topo.world_size}, data-parallel size: {topo.dp}, tensor-model-parallel "
            f"size: {topo.tp}, pipeline-model-parallel size: {topo.pp}, virtual pipeline stages per rank: "
            f"{topo.vpp}, sequence parallel: {p.sequence_parallel}, distributed optimizer: "
            f"{p.use_distributed_optimizer}, device {topo.device} / {topo.backend}")


def arguments_block(cfg) -> str:
    """Megatron's listing of the resolved arguments, one per line, sorted by name."""
    flat = cfg.to_flat()
    lines = ["------------------------ arguments ------------------------"]
    lines += [f"  {name} {'.' * max(48 - len(name), 3)} {flat[name]}" for name in sorted(flat)]
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def parameters_per_rank(model_chunks: list, topo) -> list[tuple[int, int, int, int]]:
    """Collective: (tp_rank, pp_rank, dp_rank, parameters held) of every rank."""
    count = sum(_local_numel(p) for chunk in model_chunks for p in chunk.parameters())
    mine = torch.tensor([topo.tp_rank, topo.pp_rank, topo.dp_rank, count], dtype=torch.int64,
                        device=topo.device)
    if topo.world_size == 1:
        return [tuple(int(v) for v in mine.tolist())]
    rows = [torch.empty_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(rows, mine)
    return [tuple(int(v) for v in row.tolist()) for row in rows]


def parameter_lines(rows: list[tuple[int, int, int, int]]) -> list[str]:
    """Megatron's per-(tensor, pipeline)-rank line for the data-parallel rank 0 copies, then each
    stage's parameters summed over its tensor-parallel ranks (a tied embedding counts on the first
    and on the last stage, as it is held there)."""
    first_copy = sorted((pp, tp, n) for tp, pp, dp, n in rows if dp == 0)
    lines = [f" > number of parameters on (tensor, pipeline) model parallel rank ({tp}, {pp}): {n}"
             for pp, tp, n in first_copy]
    stages: dict[int, int] = {}
    for pp, _, n in first_copy:
        stages[pp] = stages.get(pp, 0) + n
    lines.append(" > parameters per pipeline stage: " +
                 ", ".join(f"stage {pp}: {n:,}" for pp, n in sorted(stages.items())) +
                 f" (total {sum(stages.values()):,})")
    return lines


def dataset_lines(targets: tuple[int, int, int], datasets) -> list[str]:
    """Megatron's target sizes (samples each split must provide) and the sizes built."""
    names = ("train", "validation", "test")
    lines = [" > datasets target sizes (minimum size):"]
    lines += [f"    {name + ':':<11} {n}" for name, n in zip(names, targets)]
    lines.append(" > dataset sizes (samples):")
    lines += [f"    {name + ':':<11} {len(ds) if ds is not None else 'none'}"
              for name, ds in zip(names, datasets)]
    return lines


def run_directory(cfg) -> str | None:
    """Where a run's record files go: --save, else --tensorboard-dir, else nowhere."""
    return cfg.checkpoint.save or cfg.logging.tensorboard_dir or None


def settable_fields() -> set[str]:
    """Config fields a flag (or a config file) sets; the others are derived."""
    return {a.dest for a in build_parser()._actions if a.option_strings}


def write_resolved_config(cfg, directory: str) -> str:
    """Write the resolved configuration as TOML (`--config FILE` reads it back); returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RESOLVED_CONFIG)
    sections = {name: dict(vars(getattr(cfg, name))) for name in SECTIONS}
    header = [f"megafab {megafab.__version__}: the resolved configuration of the run started "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')} with world size {cfg.parallel.world_size}",
              f"command line: {' '.join(sys.argv)}",
              "run it again: megafab-pretrain --config THIS_FILE [flags that override it]; defaults "
              "derived from other values (lr_decay_iters from train_iters, ffn_hidden_size, ...) are "
              "written out, so override them too when you change what they were derived from"]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(resolved_config_toml(sections, settable_fields(), header))
    os.replace(tmp, path)
    return path


def memory_usage(device: torch.device) -> dict[str, float]:
    """MB: CUDA's allocated / max allocated / reserved / max reserved; on CPU the process's resident
    memory now and at its peak."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device) / MB,
                "max allocated": torch.cuda.max_memory_allocated(device) / MB,
                "reserved": torch.cuda.memory_reserved(device) / MB,
                "max reserved": torch.cuda.max_memory_reserved(device) / MB}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak_mb = peak / MB if sys.platform == "darwin" else peak / 1024.0
    usage = {"max resident": peak_mb}
    try:
        with open("/proc/self/statm") as f:
            usage = {"resident": int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB, **usage}
    except OSError:
        pass
    return usage


def memory_line(rank: int, iteration: int, device: torch.device) -> str:
    fields = " | ".join(f"{k}: {v:.2f}" for k, v in memory_usage(device).items())
    return f"[Rank {rank}] (after {iteration} iterations) memory (MB) | {fields}"


class MemoryReport:
    """Megatron's report_memory: after the first logged iterations, until one after the second
    iteration of this run (so that the optimizer state is in it), on data-parallel rank 0."""

    def __init__(self, start_iteration: int):
        self.start_iteration = start_iteration
        self.pending = True

    def after_log(self, topo, iteration: int) -> None:
        if not self.pending:
            return
        if topo.dp_rank == 0:
            print(memory_line(topo.rank, iteration, topo.device), flush=True)
        if iteration > self.start_iteration + 1:
            self.pending = False
