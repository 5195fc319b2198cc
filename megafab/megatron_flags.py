"""Megatron-LM flags that megafab refuses, or accepts without effect, each with its reason.

A refused flag stops the run by name (in the one message that lists every problem of a command
line); a value that means "feature off" (the `off` values) is accepted, since it asks for nothing.
A no-effect flag is accepted and announced once at start-up: "accepted, no effect in megafab: ...".
Every other Megatron flag megafab knows is parsed into the config and honoured.
"""

from __future__ import annotations

from dataclasses import dataclass

NOT_YET = "not implemented in megafab yet"
FSDP = ("megafab runs Megatron-FSDP's sharding strategies on torch FSDP2 (--use-megatron-fsdp), "
        "which has no such buffers to tune")
DEEPEP = "DeepEP / HybridEP kernels (the flex dispatcher) are GPU-only and not in megafab; use "\
    "--moe-token-dispatcher-type alltoall or allgather"


@dataclass(frozen=True)
class Refused:
    reason: str
    off: tuple[str, ...] = ()  # values that ask for nothing, accepted silently


REFUSED: dict[str, Refused] = {
    "--hierarchical-context-parallel-sizes": Refused(
        f"hierarchical context parallelism (--cp-comm-type a2a+p2p) is {NOT_YET}"),
    # megatron-core 0.16.1's MoE flags megafab has no field for (the others are cfg.moe's)
    "--moe-use-upcycling": Refused(f"upcycling a dense checkpoint into an MoE model is {NOT_YET}"),
    "--moe-upcycling-granularity": Refused(
        f"upcycling a dense checkpoint into an MoE model is {NOT_YET}", off=("1",)),
    "--moe-pad-experts-for-cuda-graph-inference": Refused(
        "CUDA-graph inference is GPU-only and not in megafab"),
    "--moe-enable-routing-replay": Refused(f"MoE routing replay is {NOT_YET}"),
    "--moe-router-padding-for-quantization": Refused(
        "routing-map padding for FP8/FP4 grouped GEMMs is a Transformer Engine GPU path not in megafab"),
    "--moe-router-padding-for-fp8": Refused(
        "routing-map padding for FP8/FP4 grouped GEMMs is a Transformer Engine GPU path not in megafab"),
    "--moe-router-force-load-balancing": Refused(f"forced (benchmark-only) balanced routing is {NOT_YET}"),
    "--moe-use-legacy-grouped-gemm": Refused(
        "the legacy GroupedMLP needs the GPU-only grouped_gemm package; --moe-grouped-gemm uses torch's "
        "grouped matmul"),
    "--moe-enable-deepep": Refused(DEEPEP),
    "--moe-flex-dispatcher-backend": Refused(DEEPEP),
    "--moe-deepep-num-sms": Refused(DEEPEP),
    "--moe-hybridep-num-sms": Refused(DEEPEP),
    "--moe-per-layer-logging": Refused(f"per-layer MoE loss logging is {NOT_YET} (the losses are logged "
                                       f"summed over layers, under Megatron's names)"),
    "--moe-layer-recompute": Refused(f"recomputing the MoE layer is {NOT_YET} (Megatron deprecates the "
                                     f"flag for --recompute-modules moe)"),
    "--moe-apply-probs-on-input": Refused(f"applying routing probabilities to the expert input is {NOT_YET}"),
    "--moe-latent-size": Refused(f"MoE latent projections are {NOT_YET}"),
    "--overlap-moe-expert-parallel-comm": Refused(
        f"overlapping expert-parallel communication with another micro-batch's compute (CUDA streams) "
        f"is {NOT_YET}"),
    "--multi-latent-attention": Refused(f"multi-latent attention is {NOT_YET}"),
    "--mtp-num-layers": Refused(f"multi-token prediction is {NOT_YET}"),
    "--tp-comm-overlap": Refused(f"TP communication overlap (Transformer Engine userbuffers) is {NOT_YET}"),
    "--fsdp-double-buffer": Refused(f"Megatron-FSDP buffer tuning; {FSDP}"),
    "--fsdp-manual-registration": Refused(f"Megatron-FSDP buffer registration; {FSDP}"),
    "--use-nccl-ub": Refused(f"NCCL user-buffer registration is {NOT_YET}"),
    "--num-distributed-optimizer-instances": Refused(
        f"the hierarchical distributed optimizer is {NOT_YET}", off=("1",)),
    "--fp8-param-gather": Refused(
        f"FP8 parameter storage and all-gather are {NOT_YET}; --fp8-format keeps bf16 parameters"),
    "--spec": Refused("custom layer specs cannot be loaded; megafab builds megatron-core's GPT layer "
                      "(--transformer-impl local or transformer_engine)"),
    "--use-legacy-models": Refused("Megatron's legacy models are not implemented; megafab's model is "
                                   "megatron-core's GPTModel"),
    "--retro-project-dir": Refused(f"Retro is {NOT_YET}"),
    "--use-tp-pp-dp-mapping": Refused(f"the tp-pp-dp rank order is {NOT_YET} (megafab uses Megatron's "
                                      f"default tp-cp-ep-dp-pp)"),
    "--encoder-num-layers": Refused("encoder-decoder models are not implemented; use --num-layers"),
    "--decoder-num-layers": Refused("encoder-decoder models are not implemented; use --num-layers"),
    "--pipeline-model-parallel-layout": Refused(
        f"custom pipeline layouts are {NOT_YET}; use --decoder-first/last-pipeline-num-layers or "
        f"--account-for-embedding/loss-in-pipeline-split"),
    "--step-batch-size-schedule": Refused(
        "this is Megatron-LM after core 0.16 (its replacement of --rampup-batch-size); megafab follows "
        "0.16.1: use --rampup-batch-size START INCREMENT SAMPLES"),
    "--cpu-offloading": Refused(f"activation CPU offloading is {NOT_YET}"),
    "--recompute-activations-offload": Refused(f"activation CPU offloading is {NOT_YET}"),
    "--delay-wgrad-compute": Refused(f"delayed weight-gradient computation is {NOT_YET}"),
    "--record-memory-history": Refused(f"CUDA memory-history snapshots are {NOT_YET}"),
    "--async-save": Refused(f"asynchronous checkpoint saves are {NOT_YET}; saves are synchronous and atomic"),
    "--non-persistent-save-interval": Refused(f"non-persistent checkpoints are {NOT_YET}"),
    "--non-persistent-ckpt-type": Refused(f"non-persistent checkpoints are {NOT_YET}"),
    "--ckpt-convert-format": Refused(
        "convert with tools/convert_checkpoint.py convert --saver torch|torch_dist"),
    "--dist-ckpt-strictness": Refused(
        "megafab loads strictly: a key the model needs and the checkpoint lacks is an error, extra "
        "checkpoint keys are ignored (Megatron's default)", off=("assume_ok_unexpected",)),
}

KERNELS = "a kernel-fusion choice of Megatron's; megafab runs these ops in eager PyTorch (--compile fuses)"

NO_EFFECT: dict[str, str] = {
    "--moe-extended-tp": "deprecated since megatron-core 0.10, which ignores it too; "
                         "--expert-tensor-parallel-size sets the experts' TP",
    "--use-mcore-models": "megafab's model is megatron-core's GPTModel; there is no other to choose",
    "--use-flash-attn": "PyTorch SDPA uses flash attention where it can; choose with --attention-backend",
    "--no-masked-softmax-fusion": "the softmax runs inside PyTorch's SDPA kernel",
    "--masked-softmax-fusion": "the softmax runs inside PyTorch's SDPA kernel",
    "--attention-softmax-in-fp32": "the softmax runs inside PyTorch's SDPA kernel",
    "--no-bias-gelu-fusion": KERNELS,
    "--bias-gelu-fusion": KERNELS,
    "--bias-swiglu-fusion": KERNELS,
    "--no-bias-swiglu-fusion": KERNELS,
    "--no-bias-dropout-fusion": KERNELS,
    "--bias-dropout-fusion": KERNELS,
    "--no-rope-fusion": KERNELS,
    "--no-persist-layer-norm": "persistent LayerNorm is an Apex kernel; megafab uses PyTorch's norms",
    "--no-async-tensor-model-parallel-allreduce": "deprecated in Megatron-LM; nothing to turn off",
    "--use-torch-optimizer-for-cpu-offload": "megafab's optimizer CPU offload always steps with torch's "
                                             "AdamW (fused where torch has it)",
    "--overlap-cpu-optimizer-d2h-h2d": "megafab's optimizer CPU offload always overlaps its copies with "
                                       "the CPU step on CUDA (and has nothing to overlap on CPU)",
    "--init-model-with-meta-device": "always on with --use-torch-fsdp2 (Megatron: FSDP only): the model "
                                     "is built on the meta device, each rank's shards filled one layer "
                                     "at a time; DDP and the distributed optimizer hold every weight",
    "--use-dist-ckpt": "deprecated in Megatron-LM (see --ckpt-format); torch_dist is the default",
    "--ckpt-fully-parallel-save": "every rank writes only its own boxes of a torch_dist checkpoint",
    "--no-ckpt-fully-parallel-save": "every rank writes only its own boxes of a torch_dist checkpoint",
    "--ckpt-fully-parallel-load": "every rank reads only its own boxes of a torch_dist checkpoint",
    "--dist-ckpt-optim-fully-reshardable": "megafab's torch_dist optimizer state is always fully "
                                           "reshardable (Megatron's fully_reshardable layout)",
    "--ckpt-assume-constant-structure": "megafab plans every save anew",
}


def refused_problem(flag: str) -> str:
    return f"{flag}: refused, {REFUSED[flag].reason}; remove it (megafab never ignores a flag)"
