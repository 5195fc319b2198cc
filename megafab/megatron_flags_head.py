"""Megatron-LM HEAD's flags (main after core 0.16.1, at the commit of tests/config/fixtures/
megatron_flags_head.json) that megafab refuses or accepts without effect, and the values of honoured
flags' choice lists that megafab refuses by name. megafab.megatron_flags registers them into its
REFUSED / NO_EFFECT / NARGS tables, with the 0.16.1 families' reasons where a family goes on
(refused(r) reads them from that module, `r`). Specs as there: "--flag" a switch, "V" one value,
"V+" / "V*" a list.
"""

from __future__ import annotations

from megafab.megatron_flags_no_effect import _ONLY_WITH, _TIMING, KERNELS, LISTED

_NOT_YET = "not implemented in megafab yet"
_GROUPED = "Transformer Engine's grouped-tensor and block-interleaved GLU weight layouts are GPU paths " \
    "not in megafab (they change the parameters' layout)"
_LOGITS = f"knowledge distillation from saved top-k logits is {_NOT_YET}"
_GTP = f"GTP weight-rematerialization sharding (weights split past the tensor-parallel group) is {_NOT_YET}"
_QUANTILE = f"quantile-balancing routing is {_NOT_YET}"
_LION = "the Lion optimizer is not in megafab (--optimizer adam or sgd)"
_PAGED_STASH = "a GPU memory layout (Triton kernels) for the routed experts' saved activations; the " \
    "same values, and megafab keeps them as PyTorch's autograd does"
_CKPT_SPREAD = "how Megatron spreads a fully parallel torch_dist save or load over ranks; megafab's " \
    "ranks each read and write only their own boxes and plan every save anew (the same checkpoint)"
_TRACES = "a profiling or trace output of Megatron's that megafab does not write; training computes " \
    "the same values"
_NO_TOKENIZER_FILES = "megafab writes no tokenizer files into checkpoints; nothing to turn off"
# pretrain_gpt.py's own flags beyond Megatron's parser (megatron/post_training/arguments.py, added when
# nvidia-modelopt is installed; --enable-gpt-oss and --export-force-local-attention are honoured)
_MODELOPT = "Megatron-LM's ModelOpt integration (knowledge distillation, quantization, export, Hugging " \
    "Face dataset finetuning, ModelOpt checkpoints) is not in megafab"
_FLIGHT_RECORDER = "megafab sets no NCCL flight-recorder variables: set TORCH_FR_DUMP_TEMP_FILE and the " \
    "TORCH_NCCL_* ones in the environment, torch reads them"


def refused(r) -> tuple[tuple[str, str], ...]:
    """(reason, spec) per family of HEAD's refused flags; `r` is megafab.megatron_flags."""
    return (
        (r._MAMBA, """--hybrid-layer-pattern V --mtp-hybrid-override-pattern V
    --mamba-inference-conv-states-dtype V --mamba-inference-ssm-states-dtype V
    --mamba-training-ssm-states-dtype V --gdp-num-householder V --gdp-cutedsl-kernel
    --gdp-num-chunk-states-to-recompute V"""),
        (r._ATTENTION, """--dsa-indexer-topk-freq V --dsa-indexer-skip-topk-offset V --dsa-kernel-backend V
    --dsa-indexer-rope-interleaved --no-dsa-indexer-rotate-activation --disable-dsa-indexer-rotate-activation
    --no-dsa-indexer-scoring-relu --disable-dsa-indexer-scoring-relu --dsa-indexer-k-norm-epsilon V
    --dsa-indexer-k-norm-fp32"""),
        (f"the fused MLA down-projection (one linear_qkv_down_proj weight) is {_NOT_YET}; megafab's MLA "
         f"keeps megatron-core's separate q and kv down-projections", "--mla-down-proj-fusion"),
        (r._INFERENCE, """--inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens V
    --inference-cuda-graph-scope V --inference-disable-ep-consensus --no-inference-disable-ep-consensus
    --inference-disable-triton-nvls-kernels --inference-dynamic-batching-async-sched-mode V
    --inference-dynamic-batching-cuda-graph-sizing-distribution V --inference-dynamic-batching-logprobs-mode V
    --inference-dynamic-batching-mamba-memory-ratio V --inference-dynamic-batching-prefix-caching
    --no-inference-dynamic-batching-prefix-caching
    --inference-dynamic-batching-prefix-caching-coordinator-policy V
    --inference-dynamic-batching-prefix-caching-eviction-policy V
    --inference-dynamic-batching-prefix-caching-mamba-gb V
    --inference-dynamic-batching-prefix-caching-routing-alpha V
    --inference-dynamic-batching-sampling-backend V --inference-dynamic-batching-track-generated-token-events
    --inference-grouped-gemm-backend V --inference-moe-disable-fused-quant-kernels
    --inference-moe-token-dispatcher-type V --inference-shards V --inference-text-gen-server-logging
    --no-inference-text-gen-server-logging --inference-use-synchronous-zmq-collectives
    --no-inference-use-synchronous-zmq-collectives --num-speculative-tokens V
    --use-same-sampling-seed-across-dp-ranks"""),
        (r._RL, """--rl-consumption-granularity V --rl-durable-rollout-bank --rl-generation-lag V
    --rl-inference-parsers V* --rl-kv-cache-management-mode V --rl-max-inflight-requests V
    --rl-persist-cuda-graphs --no-rl-persist-cuda-graphs --rl-profile --rl-profile-dir V
    --rl-rollout-bank-dir V --rl-rollout-bank-max-bytes V --rl-submission-granularity V"""),
        (r._CUDA_GRAPHS, "--cuda-graph-modules V+ --optimizer-cuda-graph"),
        (r._OFFLOAD, """--activation-offload-fraction V --delta-offload-bytes-across-pp-ranks V
    --fine-grained-offloading-max-inflight-offloads V --delay-offload-until-cuda-graph
    --cpu-offloading-retain-pinned-cpu-buffers"""),
        (r.DEEPEP, """--moe-flex-dispatcher-num-sms V --moe-hybridep-num-blocks-permute V
    --moe-hybridep-num-blocks-unpermute V --moe-hybridep-num-sms-preprocessing V
    --moe-hybridep-pad-uneven-dispatch-inputs --moe-permute-fusion-into-hybridep --moe-ncclep-zero-copy
    --moe-dispatch-fwd-dtype V --moe-combine-bwd-dtype V --moe-expert-rank-capacity-factor V"""),
        (_GROUPED, """--moe-single-grouped-weight --moe-single-grouped-bias --use-grouped-gemm-for-dense-mlp
    --use-grouped-gemm-for-shared-expert --moe-mlp-glu-interleave-size V
    --moe-shared-expert-glu-interleave-size V"""),
        (f"a random expert bias on the router logits (a benchmarking aid) is {_NOT_YET}",
         "--moe-router-force-biased V"),
        (_QUANTILE, "--moe-router-quantile-balancing-ema V"),
        (f"this multi-token-prediction variant is {_NOT_YET}",
         "--mtp-detach-heads --mtp-hsm --mtp-use-repeated-layer"),
        (f"manifold-constrained hyper-connections (mHC) are {_NOT_YET}", """--enable-mhc-connections
    --mhc-num-residual-streams V --mhc-sinkhorn-iterations V --mhc-init-gating-factor V
    --mhc-recompute-layer-num V"""),
        (f"the maximal update parameterization (muP) is {_NOT_YET}", """--use-mup --mup-width-mult V
    --mup-base-hidden-size V --mup-embedding-mult V --mup-output-mult V --mup-base-head-dim V
    --mup-attn-scale-power V"""),
        (_LION, "--lion-beta1 V --lion-beta2 V"),
        (r._MUON, "--muon-nesterov --muon-coefficient-type V --muon-use-syrk --muon-scalar-optimizer V"),
        (_GTP, """--tensor-parallel-num-weight-shards V --expert-tensor-parallel-num-weight-shards V
    --gtp-remat-opt-in-modules V+ --gtp-remat-nccl-ub --gtp-expert-remat-nccl-ub
    --gtp-remat-reduce-scatter-with-fp32-accumulation"""),
        (r._FP8, "--fp8-output-proj"),
        (r._PRECISION, "--output-logit-dtype V"),
        (r._DDP, "--ddp-param-name-patterns-for-fp32-local-accumulation V+"),
        (f"Megatron-FSDP buffer tuning; {r.FSDP}", """--megatron-fsdp-enable-fine-grained-param-gather
    --megatron-fsdp-max-pool-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail"""),
        ("Megatron-FSDP's version 2 implementation is not in megafab; megafab runs Megatron-FSDP's sharding "
         "strategies on torch FSDP2 (--use-megatron-fsdp)", "--megatron-fsdp-version V"),
        (r._FT, """--fault-injector-ranks V --fault-injector-num-ranks V --fault-injector-fault-types V
    --fault-injector-fault-probabilities V --fault-injector-fault-delay V
    --fault-injector-delay-start-iteration V --fault-injector-mtti-seconds V
    --fault-injector-offset-seconds V --fault-injector-seed V"""),
        (r._CKPT, "--override-ckpt-iteration V --ckpt-drop-redundant-extra-state"),
        (r._TOKENIZER, """--tokenizer-hf-no-use-fast --tokenizer-hf-no-include-special-tokens
    --no-tokenizer-sentencepiece-ignore-extra-whitespaces
    --disable-tokenizer-sentencepiece-ignore-extra-whitespaces --null-tokenizer-eod-id V
    --null-tokenizer-pad-id V --use-gigatoken"""),
        ("megafab pads the vocabulary to --make-vocab-size-divisible-by x TP unless --padded-vocab-size "
         "is given (then used as given)", "--no-pad-vocab-size --disable-pad-vocab-size"),
        (r._SFT, "--chat-template V"),
        (r._VALIDATION, "--validation-set-names V+"),
        (f"delaying the first evaluation is {_NOT_YET}; megafab evaluates every --eval-interval iterations",
         "--start-eval-at-iter V"),
        (f"freezing the model's layers is {_NOT_YET}", "--freeze-all-layers"),
        (_LOGITS, """--logits-save-top-k V --logits-save-top-p V --logits-save-top-p-min-k V
    --logits-save-dir V --logits-save-dtype V --logits-load-dir V --logits-load-decode-threads V
    --logits-load-prefetch-factor V --logits-load-msc-prefetch-depth V --logits-load-kd-loss-alpha V
    --logits-load-ignore-errors"""),
        (_MODELOPT, """--export-model-type V --export-legacy-megatron --export-te-mcore-model
    --export-default-te-spec --export-kv-cache-quant V --export-real-quant-cfg V --export-quant-cfg V
    --export-kd-teacher-load V --export-kd-teacher-model-config V --export-kd-teacher-ckpt-format V
    --export-kd-cfg V --finetune-hf-dataset V --finetune-data-split V --finetune-data-files V+
    --qad-train-target V --freeze-base-for-mtp --export-qk-l2-norm --export-moe-apply-probs-on-input
    --export-offline-model --modelopt-enabled"""),
    )


# the refused flags' values that ask for nothing (their defaults), accepted silently
OFF: dict[str, tuple[str, ...]] = {
    "--megatron-fsdp-version": ("1",), "--num-speculative-tokens": ("0",),
    "--null-tokenizer-pad-id": ("-1",), "--dsa-kernel-backend": ("none",),
    "--moe-dispatch-fwd-dtype": ("bf16",), "--moe-combine-bwd-dtype": ("bf16",),
    "--export-model-type": ("GPTModel",), "--export-kv-cache-quant": ("none",),
    "--export-real-quant-cfg": ("None",), "--finetune-data-split": ("train",)}


def refused_values(r) -> dict[str, dict[str, str]]:
    """flag -> {value: reason}: the values of Megatron's choice lists (0.16.1's and HEAD's) for flags
    megafab honours that megafab refuses by name; `r` is megafab.megatron_flags."""
    return {
        "--optimizer": {"muon": r._MUON, "dist_muon": r._MUON, "adaptive_muon": r._MUON, "lion": _LION,
                        "soap": "the SOAP optimizer is not in megafab (--optimizer adam or sgd)"},
        "--moe-router-load-balancing-type": {"quantile_balancing": _QUANTILE},
        "--moe-router-score-function": {"sqrtsoftplus": f"the sqrt(softplus) router score is {_NOT_YET}; "
                                                        f"use softmax or sigmoid"},
        "--position-embedding-type": {"mrope": r._ROPE, "relative": r._OTHER_MODELS},
        "--fp8-recipe": {"custom": r._FP8},
        "--transformer-impl": {"inference_optimized": r._INFERENCE},
        "--tokenizer-type": {"BertWordPieceCase": r._OTHER_MODELS, "BertWordPieceLowerCase": r._OTHER_MODELS,
                             "MultimodalTokenizer": r._VISION, "NullMultimodalTokenizer": r._VISION,
                             "SFTTokenizer": r._SFT},
    }


NO_EFFECT_LISTED: dict[str, str] = {
    "--flash-attention-version": LISTED["--use-flash-attn"],
    "--disable-align-grad-reduce": _TIMING,  # HEAD's spelling of --no-align-grad-reduce
    "--high-priority-a2a-comm-stream": _ONLY_WITH.format("--overlap-moe-expert-parallel-comm"),
    "--batch-invariant-backend": _ONLY_WITH.format("--batch-invariant-mode"),
    "--no-use-layer-wise-param-layout": _ONLY_WITH.format("--optimizer dist_muon"),
    "--mlp-chunks-for-training": "Megatron then runs the MLP in sequence chunks to save activation memory; "
                                 "the same values",
    "--exit-signal-handler-for-training": "an orderly exit without saving on SIGINT / SIGTERM; megafab's "
                                          "ranks stop on them as they are (--exit-signal-handler saves "
                                          "first), the same checkpoints",
    "--enable-msc": "megafab reads local files only (no msc:// paths), which Megatron's Multi-Storage "
                    "Client reads as they are",
    "--no-save-tokenizer-assets": _NO_TOKENIZER_FILES,
    "--disable-save-tokenizer-assets": _NO_TOKENIZER_FILES,
    "--no-ckpt-load-validate-sharding-integrity": "megafab's checks of a checkpoint's boxes stay on; a valid "
                                                  "checkpoint loads the same",
    "--disable-ckpt-load-validate-sharding-integrity": "megafab's checks of a checkpoint's boxes stay on; a "
                                                       "valid checkpoint loads the same",
}

NO_EFFECT_FAMILIES: tuple[tuple[str, str], ...] = (
    (KERNELS, "--fused-residual-rmsnorm --use-transformer-engine-op-fuser --moe-use-grouped-tensor"),
    (_TIMING, """--overlap-dispatch-backward-with-experts-wgrad --async-ckpt-cpu-priority V
    --async-ckpt-io-priority V --async-ckpt-use-cpu-shm --dist-ckpt-workers V"""),
    (_CKPT_SPREAD, """--ckpt-fully-parallel-load-exchange-algo V --ckpt-fully-parallel-load-per-rank-objects
    --ckpt-fully-parallel-save-process-group V --ckpt-fully-parallel-load-process-group V
    --ckpt-pg-tensors-cache-path V --ckpt-pg-tensors-cache-create"""),
    (_PAGED_STASH, """--moe-paged-stash --moe-paged-stash-page-size V
    --moe-paged-stash-buffer-size-factor-cuda V --moe-paged-stash-buffer-size-factor-cpu V"""),
    (_TRACES, """--pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack
    --pytorch-profiler-collect-chakra --record-shapes --nvtx-ranges --moe-routing-trace-path V
    --moe-routing-trace-max-training-iters V --moe-routing-trace-capture-logits
    --moe-routing-trace-capture-hidden-states --moe-routing-trace-dump-weights --otel-enabled
    --otel-service-name V --otel-span-groups V --save-params-interval V --save-activations-interval V
    --save-tokens-per-expert-interval V --gpu-sniff-test-interval V"""),
    (_FLIGHT_RECORDER, """--flight-recorder-dump-path V --flight-recorder-trace-buffer-size V
    --no-flight-recorder-dump-on-timeout --disable-flight-recorder-dump-on-timeout
    --flight-recorder-include-stack-trace --no-flight-recorder-include-only-active
    --disable-flight-recorder-include-only-active --no-flight-recorder-extra-dump-on-exec
    --disable-flight-recorder-extra-dump-on-exec"""),
)

VALUED = "--flash-attention-version V --batch-invariant-backend V --mlp-chunks-for-training V"
