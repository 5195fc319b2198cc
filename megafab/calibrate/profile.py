"""megafab-estimate --profile: measure this machine into a Machine profile the step-time model uses.

In order: the collectives at group sizes 2 and 4 where the machine has the devices or cores
(collectives.py; first, so the ranks fork before this process starts a compute thread pool); on a
CPU the host overheads and busy slowdown (host.py) and the in-step calibration steps (steps.py);
GEMMs, attention and memory bandwidth (kernels.py); then the fits that price the measured steps
with everything above (host overheads, then the in-step alphas last). The calibration rows are
kept in the profile (calibration_steps) for a later run to re-launch (steps.speed_drift).
"""

from __future__ import annotations

import os
import time

import torch

from megafab.calibrate.collectives import measure_collectives
from megafab.calibrate.host import (
    fit_host_overheads,
    measure_busy_slowdown,
    measure_host_steps,
    with_kernel_times,
)
from megafab.calibrate.kernels import measure_attention, measure_bandwidth, measure_gemms, this_device
from megafab.calibrate.steps import fit_step_collectives, measure_calibration_steps
from megafab.plan.machines import Machine


def measure(name: str = "this-machine", budget_s: float = 90.0) -> Machine:
    """This machine's profile, named `name`; budget_s bounds the GEMM sweep (half of it)."""
    device = this_device()
    cores = os.cpu_count() or 1
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    sizes = [n for n in (2, 4) if (n <= gpus if gpus else n <= max(2, 2 * cores))]
    collectives: dict = {}
    for n in sizes:  # first: ranks are forked before this process starts any compute thread pool
        for op, table in measure_collectives(n).items():
            collectives.setdefault(op, {}).update(table)
    host_rows = measure_host_steps() if device.type == "cpu" else []
    busy = measure_busy_slowdown(cores) if device.type == "cpu" else 1.0
    step_rows = measure_calibration_steps(sizes) if device.type == "cpu" else []
    deadline = time.monotonic() + budget_s * 0.5
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    if device.type == "cpu":
        torch.set_num_threads(1)  # as each rank runs (one thread per rank)
    gemms = []
    for dtype in dtypes:
        gemms += measure_gemms(dtype, deadline)
    peaks = {}
    for row in gemms:
        peaks[row[3]] = max(peaks.get(row[3], 0.0), 2.0 * row[0] * row[1] * row[2] / row[4] / 1e12)
    att_f, att_b = measure_attention(dtypes[-1], 1e12 * peaks[str(dtypes[-1]).replace("torch.", "")])
    bandwidth = measure_bandwidth()
    ring = collectives.get("all_gather", {}).get("2", [5e-5, 1e9])
    link = collectives.get("send_recv", {}).get("2", ring)
    if device.type == "cuda":
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    machine = Machine(
        name=name, peak_tflops=peaks, device_memory_gib=memory_gib, hbm_bandwidth=bandwidth,
        gpus_per_node=max(gpus, 1024), intra_busbw=ring[1], intra_latency_s=ring[0], nic_bandwidth=link[1],
        inter_latency_s=link[0], gemm_efficiency=1.0, kernel_overhead_s=0.0,
        attention_fwd_efficiency=att_f, attention_bwd_efficiency=att_b, attention_seq_half=0.0,
        hbm_efficiency=1.0, gemm_points=gemms, collectives=collectives, iteration_overhead_s=0.0,
        host_memory_gib=memory_gib, compute_slots=0 if gpus else cores, busy_slowdown=busy,
        source=f"measured by megafab-estimate --profile on {device.type}")
    if host_rows:
        machine.host_overheads = fit_host_overheads(with_kernel_times(host_rows, machine))
    fit_step_collectives(step_rows, machine)  # last: it prices the steps with everything above
    machine.calibration_steps = step_rows
    return machine
