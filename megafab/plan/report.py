"""Text of predictions: one candidate's line, the search's table, and pretrain --dry-run's line."""

from __future__ import annotations

from megafab.plan.machines import BUILTIN, Machine
from megafab.plan.step_time import predict

# GPU name fragments (torch.cuda.get_device_name) -> built-in profile
GPU_NAMES = {"H200": "h200-sxm-141gb", "H100": "h100-sxm-80gb", "A100": "a100-sxm-80gb", "B200": "b200"}


def prediction_line(pred, machine: Machine) -> str:
    parts = ", ".join(f"{name} {seconds / pred.step_time_s:.0%}"
                      for name, seconds in pred.breakdown.items() if seconds / pred.step_time_s >= 0.005)
    return (f"  predicted on {machine.name}: {pred.step_time_s:.3f} s/iteration, {pred.tokens_per_s:,.0f} "
            f"tokens/s, {pred.tflops_per_gpu:.1f} TFLOP/s per device, MFU {pred.mfu:.1%} ({parts})")


def candidate_row(rank: int | str, cand) -> str:
    p = cand.prediction
    layout = f"TP{cand.tp} PP{cand.pp}" + (f" VPP{cand.vpp}" if cand.vpp > 1 else "") \
        + (f" CP{cand.cp}" if cand.cp > 1 else "") + (f" EP{cand.ep}" if cand.ep > 1 else "") \
        + (f" ETP{cand.etp}" if cand.etp != cand.tp else "") + f" DP{cand.dp}" \
        + (" SP" if cand.sequence_parallel else "")
    return (f"{rank:>4} {layout:<26} mbs {cand.micro_batch_size:<2} {cand.recompute:<9} {cand.sharding:<21} "
            f"{cand.memory_gib:7.1f} GiB {p.step_time_s:9.3f} s {p.tokens_per_s:12,.0f} "
            f"{p.tflops_per_gpu:8.1f} {p.mfu:6.1%}\n       {' '.join(cand.flags)}")


HEADER = (f"{'rank':>4} {'layout':<26} {'mbs':<6} {'recompute':<9} {'sharding':<21} {'memory':>11} "
          f"{'step':>11} {'tokens/s':>12} {'TFLOP/s':>8} {'MFU':>6}")


def local_machine() -> Machine | None:
    """The built-in profile of this process's GPU, None without a known GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((BUILTIN[v] for k, v in GPU_NAMES.items() if k in name), None)


def dry_run_prediction(cfg, stages, machine: Machine | None = None) -> str:
    """pretrain --dry-run's step-time line(s): the model's prediction for `machine` (default: this
    process's GPU) instead of a fixed MFU guess."""
    machine = machine or local_machine()
    if machine is None:
        return ("  step time: no known GPU here; megafab-estimate <these flags> --gpu h100-sxm-80gb (or "
                "--machine FILE from megafab-estimate --profile) predicts it")
    return prediction_line(predict(cfg, machine, stages), machine)
