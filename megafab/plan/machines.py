"""Machine profiles: what one device and its links achieve, as the step-time model needs it.

A profile is a Machine dataclass: built in for common 8-GPU nodes (`--gpu NAME`), or a JSON file
(`--machine FILE`, written by `megafab-estimate --profile`, which measures the machine it runs on:
megafab.calibrate). Compute times come from shapes, not from one efficiency number
(gemm_seconds, attention_seconds, memory_seconds); collectives from the link fields
(megafab.plan.collectives). A measured CPU profile also carries CPU-only terms (host overheads,
compute slots and their busy slowdown, in-step collective entries): megafab.plan.host_terms
prices them; a GPU's profile has none.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from megafab.errors import MegafabError


class MachineError(MegafabError):
    """A machine name or profile file that cannot be used."""


@dataclass
class Machine:
    name: str
    peak_tflops: dict[str, float]  # dense TFLOP/s per dtype name (bfloat16, float16, float32, float64)
    device_memory_gib: float  # what a process can allocate
    hbm_bandwidth: float  # bytes/s
    gpus_per_node: int
    intra_busbw: float  # bytes/s: NCCL ring bus bandwidth of a group inside one node
    intra_latency_s: float  # per ring step inside a node
    nic_bandwidth: float  # bytes/s one GPU's NIC achieves across nodes
    inter_latency_s: float  # per ring step across nodes
    collective_base_latency_s: float = 0.0  # per collective call, on top of its steps (NCCL's baseLat)
    # NCCL's other ring protocols: name -> [base_s, NVLink step_s, network step_s, share of busbw];
    # the fields above are its Simple protocol's (collectives.py); none in a measured profile
    ring_protocols: dict = field(default_factory=dict)
    net_overhead_s: float = 0.0  # NCCL's per-step network post overhead (multi-node rings)
    gemm_efficiency: float = 0.75
    gemm_tile_m: int = 128
    gemm_tile_n: int = 256
    sm_count: int = 132
    gemm_k_overhead: float = 256.0
    kernel_overhead_s: float = 4e-6
    attention_fwd_efficiency: float = 0.55
    attention_bwd_efficiency: float = 0.40
    attention_seq_half: float = 512.0
    hbm_efficiency: float = 0.8
    pcie_bandwidth: float = 25e9  # bytes/s, device <-> pinned host, each direction
    host_adam_params_per_s: float = 2e8  # CPU Adam updates per second available to one device
    host_memory_gib: float = 250.0  # host memory per device
    # per step: grad-norm host sync, loss scaler, logging of a GPU step (an estimate, not sourced;
    # a measured profile sets 0 and fits host_overheads' step_s instead)
    iteration_overhead_s: float = 0.005
    # Host (Python) work the kernels' times do not include, per sharding ("none" for DDP,
    # "distributed_optimizer", "fsdp2") -> {"step_s": per step (the rest of train_step),
    # "micro_batch_s": per micro-batch on each pipeline stage (the schedule, the embedding and loss
    # modules, the data), "layer_micro_batch_s": per transformer layer per micro-batch (its modules'
    # forward and backward calls, autograd, DDP's / FSDP2's per-parameter and per-unit hooks),
    # "param_tensor_s": per parameter tensor the rank's optimizer steps (grad norm, clipping, Adam's
    # per-tensor lists, zeroing), "recomputed_layer_micro_batch_s": per fully recomputed layer per
    # micro-batch on top (its checkpointed forward again, RNG states saved and restored),
    # "selective_layer_micro_batch_s": per selectively recomputed layer}. A measured CPU profile
    # fits them from megafab's own train_step (megafab.calibrate.host); built-in GPU
    # profiles have none (0): the host runs ahead of the kernels, whose launch cost is
    # kernel_overhead_s, and iteration_overhead_s is the step's host sync.
    host_overheads: dict = field(default_factory=dict)
    compute_slots: int = 0  # devices of a node that compute at once (CPU: its cores); 0: every device
    # how much slower one rank's step runs when every slot computes than when it computes alone
    # (a CPU's shared caches, memory bandwidth and clocks; megafab.calibrate.host, 1 on GPUs)
    busy_slowdown: float = 1.0
    # Measured profiles: [m, n, k, dtype, seconds] rows and fitted collectives (megafab.calibrate).
    gemm_points: list = field(default_factory=list)
    # op -> group size -> [alpha_s, busbw bytes/s]; a CPU profile's in-step keys: host_terms
    collectives: dict = field(default_factory=dict)
    # a CPU profile's in-step calibration rows with their measured steps (calibrate.steps), kept
    # so a later run on the machine can tell how far its speed has moved since the profile
    calibration_steps: list = field(default_factory=list)
    source: str = "built-in"

    def peak(self, dtype: str) -> float:
        """FLOP/s at peak for dtype (bf16 when the profile has no such entry)."""
        return 1e12 * self.peak_tflops.get(dtype, self.peak_tflops.get("bfloat16", 0.0))

    # -- compute -----------------------------------------------------------------------------------
    def gemm_seconds(self, m: int, n: int, k: int, dtype: str, e: int) -> float:
        """One [m, k] x [k, n] GEMM of dtype with e-byte elements: 2mnk FLOPs at peak x gemm_efficiency
        (what large GEMMs sustain at the clocks a training run holds), times two shape losses: wave
        quantization (output tiles of gemm_tile_m x gemm_tile_n spread over sm_count SMs; the last
        wave runs partly empty) and the per-tile prologue/epilogue, k / (k + gemm_k_overhead) (a
        short inner dimension pays it often); plus kernel_overhead_s per kernel (launch and tail).
        Bounded below by the bytes it moves over HBM. A measured profile's gemm_points replace the
        curve (the achieved rate interpolated by GEMM size)."""
        flops = 2.0 * m * n * k
        if flops == 0:
            return 0.0
        measured = [row for row in self.gemm_points if row[3] == dtype]
        if measured:
            return flops / _interpolated_rate(measured, flops)
        tiles = math.ceil(m / self.gemm_tile_m) * math.ceil(n / self.gemm_tile_n)
        waves = tiles / self.sm_count
        wave_use = waves / math.ceil(waves)
        k_use = k / (k + self.gemm_k_overhead)
        rate = self.peak(dtype) * self.gemm_efficiency * wave_use * k_use
        memory = self.memory_seconds(e * (m * k + k * n + m * n))
        return max(flops / rate, memory) + self.kernel_overhead_s

    def attention_seconds(self, flops: float, keys: int, dtype: str, backward: bool) -> float:
        """Flash attention doing `flops` (what the kernel computes: causal, half of the full matrices)
        over `keys` keys per query, at attention_fwd/bwd_efficiency x peak, lower for short keys
        (s / (s + attention_seq_half))."""
        if flops == 0:
            return 0.0
        eff = self.attention_bwd_efficiency if backward else self.attention_fwd_efficiency
        eff *= keys / (keys + self.attention_seq_half)
        return flops / (self.peak(dtype) * eff) + self.kernel_overhead_s

    def memory_seconds(self, nbytes: float, kernels: int = 0) -> float:
        """Element-wise work (norms, activations, dropout, residual adds, softmax) moving nbytes over
        HBM bandwidth x hbm_efficiency in `kernels` kernels."""
        return nbytes / (self.hbm_bandwidth * self.hbm_efficiency) + kernels * self.kernel_overhead_s

    # -- files -------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> Machine:
        try:
            with open(path) as f:
                values = json.load(f)
        except (OSError, ValueError) as exc:
            raise MachineError(f"--machine {path}: cannot read a machine profile ({exc}); write one with "
                               f"megafab-estimate --profile {path}") from None
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        try:
            if unknown:
                raise TypeError(f"unknown keys {', '.join(unknown)}")
            return cls(**values)
        except TypeError as exc:
            raise MachineError(f"--machine {path}: not a megafab machine profile ({exc}); write one with "
                               f"megafab-estimate --profile {path}") from None


def _interpolated_rate(rows: list, flops: float) -> float:
    """Achieved FLOP/s at this GEMM size, piecewise linear in log(FLOPs) between measured points."""
    points = sorted((2.0 * m * n * k, 2.0 * m * n * k / s) for m, n, k, _, s in rows)
    if flops <= points[0][0]:
        return points[0][1] * flops / points[0][0]  # below the smallest: a fixed cost dominates
    for (f0, r0), (f1, r1) in zip(points, points[1:]):
        if flops <= f1:
            w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return r0 + w * (r1 - r0)
    return points[-1][1]


GiB = 2.0**30

# Sources for the numbers below.
#  [H100] NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s dense BF16/FP16 (1,979 with
#         sparsity), 67 TFLOP/s FP64 Tensor Core / FP32 67, 3.35 TB/s HBM3, NVLink 4 900 GB/s
#         (both directions), 80 GB (81,559 MiB reported by nvidia-smi), 132 SMs.
#  [H200] NVIDIA H200 datasheet: same Hopper compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s.
#  [A100] NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s BF16 dense, 19.5 FP32 (156 TF32),
#         2,039 GB/s HBM2e, NVLink 3 600 GB/s, 108 SMs; DGX A100: 8x 200 Gb/s HDR InfiniBand.
#  [B200] NVIDIA DGX B200 datasheet: 8 GPUs, 1,440 GB GPU memory (180 GB each), 72 PFLOPS FP8
#         training (sparse) -> 2.25 PFLOP/s dense BF16 per GPU, HBM3e 8 TB/s, NVLink 5 1.8 TB/s,
#         8x 400 Gb/s ConnectX-7; 148 SMs.
#  [DGX-H100] DGX H100/H200 user guide: 8x ConnectX-7 400 Gb/s (50 GB/s) compute NICs, one per GPU.
#  [NCCL] nccl-tests' PERFORMANCE.md defines bus bandwidth (ring all-reduce: algbw x 2(n-1)/n).
#         Published nccl-tests on 8x H100 SXM (NVSwitch) reach ~360-370 GB/s busbw for all-gather /
#         reduce-scatter and ring all-reduce at >= 256 MB (~480 GB/s only with NVLS all-reduce);
#         8x A100 SXM ~230 GB/s; across nodes one 400 Gb/s NIC gives ~45 GB/s (ib_write_bw ~ 390 Gb/s)
#         and 200 Gb/s HDR ~23 GB/s. Latencies as NCCL's own tuning model for its ring algorithm
#         with the Simple protocol (what messages of megabytes use; src/graph/tuning.cc, NCCL 2.18-2.19:
#         baseLat 8.4 us per call, hwLat NVLink 3.4 us and NET 14 us per ring step; the intra-node
#         steps of a multi-node ring at max(3.4, 3 x 1 us net overhead) = 3.4 us); its LL protocol
#         (small messages) 6.6 / 0.6 / 2.7 us at 1/4 of the bus bandwidth, LL128 14 / 1.9 / 4.0 us at
#         0.92 of it, and a 1 us network post overhead (Intel hosts) per multi-node step; NCCL runs
#         the fastest of the three (nccl-tests' small-message times, a few us per step, are LL's).
#  [FA] FlashAttention-2 (Dao 2023) reaches ~350 TFLOP/s forward on H100 (BF16, head dim 128, causal,
#       the kernel's own halved FLOPs) and ~250-300 backward; FlashAttention-3 (Shah et al. 2024)
#       up to ~600 forward. Hopper's 0.35 / 0.26 of peak is FA2's level, what the calibration below
#       finds for Megatron's 2024 runs (Transformer Engine's cuDNN attention); A100: FA2 50-70% of
#       312 forward, 35-45% backward (Dao 2023).
#  [GEMM] gemm_efficiency, gemm_k_overhead and kernel_overhead_s: large BF16 cuBLAS GEMMs on H100 SXM
#       sustain ~650-750 TFLOP/s at training clocks (700 W limit); the shape terms are Hopper's
#       128x256 output tiles over 132 SMs. gemm_efficiency 0.76, gemm_k_overhead 512,
#       kernel_overhead_s 10 us and the attention efficiencies were fitted once, together, on a
#       coarse grid to the 9 rows of the Megatron-core README's H100 weak-scaling table (1.7B-462B;
#       every row within 9%, tests/plan/test_published_h100.py); the other GPUs keep their own
#       datasheet peaks with the same shape constants.
#  [HBM] Achievable HBM bandwidth in streaming kernels is ~80-90% of the datasheet figure.
#  [PCIe] Gen5 x16 (H100/H200/B200) 64 GB/s per direction, ~50 GB/s pinned copies; Gen4 x16 (A100) ~25.
#  [ZeRO-Offload] Ren et al. 2021: DeepSpeed's CPU-Adam updates ~1-2 B parameters/s on a two-socket
#       host, shared here by the node's 8 GPUs (2e8 parameters/s each).
NCCL_RING = dict(ring_protocols={"LL": [6.6e-6, 0.6e-6, 2.7e-6, 0.25],
                                 "LL128": [14e-6, 1.9e-6, 4.0e-6, 0.92]}, net_overhead_s=1e-6)  # [NCCL]
HOPPER = dict(gemm_efficiency=0.76, gemm_tile_m=128, gemm_tile_n=256, sm_count=132, gemm_k_overhead=512.0,
              kernel_overhead_s=10e-6, attention_fwd_efficiency=0.35, attention_bwd_efficiency=0.26)

BUILTIN = {
    "h100-sxm-80gb": Machine(
        name="h100-sxm-80gb", peak_tflops={"bfloat16": 989.0, "float16": 989.0, "float32": 494.0,
                                           "float64": 67.0},  # [H100]; float32 runs as TF32
        device_memory_gib=81559 / 1024, hbm_bandwidth=3.35e12, gpus_per_node=8,
        intra_busbw=360e9, intra_latency_s=3.4e-6, nic_bandwidth=45e9, inter_latency_s=14e-6,  # [NCCL]
        collective_base_latency_s=8.4e-6, **NCCL_RING,
        pcie_bandwidth=50e9, host_memory_gib=2048 / 8, **HOPPER),  # [PCIe]; DGX H100 2 TB host
    "h200-sxm-141gb": Machine(
        name="h200-sxm-141gb", peak_tflops={"bfloat16": 989.0, "float16": 989.0, "float32": 494.0,
                                            "float64": 67.0},  # [H200]
        device_memory_gib=143771 / 1024, hbm_bandwidth=4.8e12, gpus_per_node=8,
        intra_busbw=360e9, intra_latency_s=3.4e-6, nic_bandwidth=45e9, inter_latency_s=14e-6,
        collective_base_latency_s=8.4e-6, **NCCL_RING,
        pcie_bandwidth=50e9, host_memory_gib=2048 / 8, **HOPPER),
    "a100-sxm-80gb": Machine(
        name="a100-sxm-80gb", peak_tflops={"bfloat16": 312.0, "float16": 312.0, "float32": 156.0,
                                           "float64": 19.5},  # [A100]; float32 runs as TF32
        device_memory_gib=81251 / 1024, hbm_bandwidth=2.039e12, gpus_per_node=8,
        intra_busbw=230e9, intra_latency_s=3.4e-6, nic_bandwidth=23e9, inter_latency_s=14e-6,
        collective_base_latency_s=8.4e-6, **NCCL_RING,
        gemm_efficiency=0.80, gemm_tile_m=128, gemm_tile_n=256, sm_count=108, gemm_k_overhead=512.0,
        kernel_overhead_s=10e-6, attention_fwd_efficiency=0.55, attention_bwd_efficiency=0.40,
        pcie_bandwidth=25e9, host_memory_gib=1024 / 8),
    "b200": Machine(
        name="b200", peak_tflops={"bfloat16": 2250.0, "float16": 2250.0, "float32": 1125.0,
                                  "float64": 40.0},  # [B200]
        device_memory_gib=180e9 / GiB * 0.99, hbm_bandwidth=8.0e12, gpus_per_node=8,
        intra_busbw=720e9, intra_latency_s=3.4e-6, nic_bandwidth=45e9, inter_latency_s=14e-6,
        collective_base_latency_s=8.4e-6, **NCCL_RING,
        gemm_efficiency=0.72, gemm_tile_m=128, gemm_tile_n=256, sm_count=148, gemm_k_overhead=512.0,
        kernel_overhead_s=10e-6, attention_fwd_efficiency=0.35, attention_bwd_efficiency=0.26,
        pcie_bandwidth=50e9, host_memory_gib=4096 / 8),
}


def machine(name: str | None = None, path: str | None = None) -> Machine:
    """The built-in profile `name`, or the profile saved in `path`."""
    if path:
        return Machine.load(path)
    if name not in BUILTIN:
        raise MachineError(f"--gpu {name}: not a built-in machine; use one of {', '.join(BUILTIN)} or "
                           f"--machine FILE (from megafab-estimate --profile FILE)")
    return dataclasses.replace(BUILTIN[name])
