"""Megatron-LM flags that megafab accepts without effect, each with the reason --help and the start-up
note give ("accepted, no effect in megafab: ..."). megafab.megatron_flags composes its NO_EFFECT
table from these (LISTED, then each family of FAMILIES) and reads the Megatron nargs of the valued
ones from the same specs ("--flag V": one value, "V+" / "V*": a list; VALUED for LISTED's).
"""

from __future__ import annotations

_TIMING = "changes only when or how fast communication or GPU work runs, never a result; megafab has " \
    "no such setting"
_ONLY_WITH = "only with {}, which megafab refuses; Megatron ignores it too without that"
KERNELS = "a kernel-fusion choice of Megatron's; megafab runs these ops in eager PyTorch (--compile fuses)"

LISTED: dict[str, str] = {
    "--moe-extended-tp": "deprecated since megatron-core 0.10, which ignores it too; "
                         "--expert-tensor-parallel-size sets the experts' TP",
    "--use-mcore-models": "megafab's model is megatron-core's GPTModel; there is no other to choose",
    "--enable-experimental": "megatron-core 0.16.1 gates only its fused token-permutation kernels behind it "
                             "(--moe-permute-fusion with the flex dispatcher or padding for quantization: "
                             "GPU kernels giving the unfused path's results, refused here); megafab has "
                             "no experimental feature to enable",
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
    "--moe-router-fusion": "Transformer Engine's fused top-k routing kernel; megafab's unfused router "
                           "computes the same values",
    "--cross-entropy-fusion-impl": "megafab's --cross-entropy-loss-fusion is megatron-core's native fused "
                                   "cross entropy; Transformer Engine's (te) computes the same values",
    "--async-strategy": "Megatron's choice of asynchronous writer (NVIDIA Resiliency Extension's or "
                        "megatron-core's); megafab has one writer, and both write the same checkpoint",
    "--non-persistent-local-ckpt-algo": "the exchange between ranks of NVIDIA Resiliency Extension's local "
                                        "checkpoints; megafab's local checkpoints are torch_dist files, the "
                                        "same with either",
}


LISTED.update({
    "--disable-async-tensor-model-parallel-allreduce":
        LISTED["--no-async-tensor-model-parallel-allreduce"],
    "--disable-ckpt-fully-parallel-save": LISTED["--no-ckpt-fully-parallel-save"],
    "--dist-ckpt-format": "deprecated in Megatron-LM, which ignores it too; --ckpt-format selects the format",
    "--fp8-interval": "deprecated: Transformer Engine ignores it since v1.8, and megafab does not pass it",
    "--use-cpu-initialization": "megafab always draws each weight's full tensor on the CPU from its own "
                                "(seed, parameter name) generator, so every TP / PP layout starts from the "
                                "one-process values (what Megatron's CPU initialization is for)",
    "--no-initialization": "megafab always initializes the weights; --load then overwrites them",
    "--local-rank": "megafab takes the local rank from LOCAL_RANK, which torchrun sets (Megatron's default "
                    "for this flag)",
    "--disable-gloo-process-groups": "megafab makes every process group on the run's one backend: no Gloo "
                                     "side groups beside NCCL ones",
    "--disable-jit-fuser": "megafab leaves megatron-core's jit_fuser as it is: it fuses elementwise kernels, "
                           "it does not change their formulas",
    "--no-gradient-reduce-div-fusion": "megafab scales gradients by 1/DP itself (or reduces with AVG); it "
                                       "has no fused division to turn off",
    "--no-clone-scatter-output-in-embedding": "a memory-release detail of the embedding under sequence "
                                              "parallelism; values are the same either way",
    "--disable-clone-scatter-output-in-embedding": "a memory-release detail of the embedding under sequence "
                                                   "parallelism; values are the same either way",
    "--no-one-logger": "megafab has no one-logger telemetry to turn off",
    "--disable-msc": "megafab reads local files only; there is no Multi-Storage Client to turn off",
    "--memory-snapshot-path": _ONLY_WITH.format("--record-memory-history"),
    "--disable-straggler-on-startup": _ONLY_WITH.format("--log-straggler"),
    "--ep-overlap-early-attn-memory-release": _ONLY_WITH.format("--overlap-moe-expert-parallel-comm"),
    "--use-nccl-ub": "NCCL user-buffer registration of the DP/FSDP communication buffers: fewer GPU SMs "
                     "spent on communication, the same values reduced; megafab's FSDP2 and DDP buffers "
                     "are PyTorch's",
    "--disable-symmetric-registration": "a detail of --use-nccl-ub's buffer registration, the same values",
    "--fsdp-double-buffer": "Megatron-FSDP's reuse of its communication buffers (memory management), the "
                            "same values; megafab's --use-megatron-fsdp runs on FSDP2, which manages its own",
    "--fsdp-manual-registration": "Megatron-FSDP's registration of its buffers with NCCL user buffers, the "
                                  "same values; megafab's --use-megatron-fsdp runs on FSDP2",
    "--export-force-local-attention": "Megatron-LM HEAD's ModelOpt builder: megatron-core's local "
                                      "DotProductAttention instead of TEDotProductAttention in its export "
                                      "spec (pretrain_gpt.py uses it only for a ModelOpt model), the same "
                                      "math; megafab's attention is PyTorch SDPA (--attention-backend)",
})

FAMILIES: tuple[tuple[str, str], ...] = (
    (_ONLY_WITH.format("--tp-comm-overlap"),
     """--no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad
    --no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag
    --disable-tp-comm-overlap-ag --no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs
    --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag --disable-tp-comm-split-ag --no-tp-comm-split-rs
    --disable-tp-comm-split-rs --tp-comm-overlap-cfg V --tp-comm-bootstrap-backend V"""),
    (_TIMING,
     """--no-align-grad-reduce --no-align-param-gather --no-overlap-p2p-communication
    --overlap-p2p-communication-warmup-flush --overlap-param-gather-with-optimizer-step
    --no-scatter-gather-tensors-in-pipeline --high-priority-stream-groups V* --create-all-gather-group
    --defer-embedding-wgrad-compute --wgrad-deferral-limit V --train-sync-interval V"""),
)

VALUED = "--cross-entropy-fusion-impl V --dist-ckpt-format V --fp8-interval V --local-rank V " \
    "--memory-snapshot-path V --async-strategy V --non-persistent-local-ckpt-algo V"
