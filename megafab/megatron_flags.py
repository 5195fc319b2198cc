"""Megatron-LM flags that megafab refuses, or accepts without effect, each with its reason.

A refused flag stops the run by name (in the one message that lists every problem of a command
line); a value that means "feature off" (the `off` values) is accepted, since it asks for nothing.
A no-effect flag is accepted and announced once at start-up: "accepted, no effect in megafab: ...";
so is a refused flag given one of its `no_effect` values (--rerun-mode validate_results, Megatron's
default). Both take the values Megatron's parser gives them (NARGS), so the rest of a Megatron
command line parses as Megatron's would. Every other Megatron flag megafab knows is parsed into the
config and honoured. tests/config/test_megatron_flag_census.py checks all of Megatron-LM 0.16.1's
and HEAD's flags against this. The no-effect entries and their reasons are megatron_flags_no_effect.py's;
HEAD's flags (and REFUSED_VALUES, values of honoured flags refused by name) megatron_flags_head.py's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from megafab import megatron_flags_head as head_flags
from megafab import megatron_flags_no_effect as no_effect_flags

NOT_YET = "not implemented in megafab yet"
FSDP = ("megafab runs Megatron-FSDP's sharding strategies on torch FSDP2 (--use-megatron-fsdp), "
        "which has no such buffers to tune")
DEEPEP = "DeepEP / HybridEP kernels (the flex dispatcher) are GPU-only and not in megafab; use "\
    "--moe-token-dispatcher-type alltoall or allgather"


@dataclass(frozen=True)
class Refused:
    reason: str
    off: tuple[str, ...] = ()  # values that ask for nothing, accepted silently
    no_effect: tuple[tuple[str, str], ...] = ()  # (value, why): accepted and announced as no effect


# Megatron's nargs for each refused or no-effect flag that takes values: None one value, "+" one or
# more, "*" any number, "?" one or none (a switch in one release, one value in another); a flag not listed
# is a switch (it takes none). Filled by _values below.
NARGS: dict[str, int | str | None] = {}
_NARGS = {"V": None, "V+": "+", "V*": "*", "V?": "?"}


def _values(spec: str) -> list[str]:
    """The flags of `spec`, "--flag" a switch, "--flag V" one value, "--flag V+" / "V*" a list; each
    valued flag's nargs into NARGS."""
    flags: list[str] = []
    for token in spec.split():
        if token.startswith("--"):
            flags.append(token)
        else:
            NARGS[flags[-1]] = _NARGS[token]
    return flags


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
    "--moe-use-legacy-grouped-gemm": Refused(
        "the legacy GroupedMLP needs the GPU-only grouped_gemm package; --moe-grouped-gemm uses torch's "
        "grouped matmul"),
    "--moe-enable-deepep": Refused(DEEPEP),
    "--moe-flex-dispatcher-backend": Refused(DEEPEP),
    "--moe-deepep-num-sms": Refused(DEEPEP),
    "--moe-hybridep-num-sms": Refused(DEEPEP),
    "--moe-apply-probs-on-input": Refused(f"applying routing probabilities to the expert input is {NOT_YET}"),
    "--moe-latent-size": Refused(f"MoE latent projections are {NOT_YET}"),
    "--overlap-moe-expert-parallel-comm": Refused(
        f"overlapping expert-parallel communication with another micro-batch's compute (CUDA streams) "
        f"is {NOT_YET}"),
    "--tp-comm-overlap": Refused(f"TP communication overlap (Transformer Engine userbuffers) is {NOT_YET}"),
    "--num-distributed-optimizer-instances": Refused(
        f"the hierarchical distributed optimizer is {NOT_YET}", off=("1",)),
    "--spec": Refused("custom layer specs cannot be loaded; megafab builds megatron-core's GPT layer "
                      "(--transformer-impl local or transformer_engine)"),
    "--use-legacy-models": Refused("Megatron's legacy models are not implemented; megafab's model is "
                                   "megatron-core's GPTModel"),
    "--retro-project-dir": Refused(f"Retro is {NOT_YET}"),
    "--encoder-num-layers": Refused("encoder-decoder models are not implemented; use --num-layers"),
    "--decoder-num-layers": Refused("encoder-decoder models are not implemented; use --num-layers"),
    "--pipeline-model-parallel-layout": Refused(
        f"custom pipeline layouts are {NOT_YET}; use --decoder-first/last-pipeline-num-layers or "
        f"--account-for-embedding/loss-in-pipeline-split"),
    "--cpu-offloading": Refused(f"activation CPU offloading is {NOT_YET}"),
    "--recompute-activations-offload": Refused(f"activation CPU offloading is {NOT_YET}"),
    "--delay-wgrad-compute": Refused(f"delayed weight-gradient computation is {NOT_YET}"),
    "--record-memory-history": Refused(f"CUDA memory-history snapshots are {NOT_YET}"),
    "--ckpt-convert-format": Refused(
        "convert with tools/convert_checkpoint.py convert --saver torch|torch_dist"),
}

def _refuse(reason: str, spec: str) -> None:
    REFUSED.update(dict.fromkeys(_values(spec), Refused(reason)))


# ---- Megatron-LM 0.16.1's other flags, by family (tests/config/test_megatron_flag_census.py checks
# that every flag of Megatron's parser is honoured, refused or no-effect, with Megatron's nargs) ----

_CUDA_GRAPHS = f"CUDA graphs are {NOT_YET} (GPU-only capture of the iteration)"
_OFFLOAD = f"activation CPU offloading is {NOT_YET}"
_MLA = "caching MLA latents is for Megatron's dynamic inference engine (Flash MLA); megafab trains " \
    "(its generation caches keys and values)"
_ATTENTION = f"this attention variant is {NOT_YET}; megafab's attention is megatron-core's softmax " \
    f"self-attention with RoPE or learned positions"
_ROPE = f"this RoPE variant is {NOT_YET}; megafab rotates half-split channel pairs with --rotary-base " \
    f"and --rotary-percent (no Llama-3.x scaling, no interpolation)"
_MAMBA = "Mamba, hybrid and gated-delta-net models are not in megafab (it trains GPT transformers)"
_HETERO = "heterogeneous (per-layer different) models are not in megafab"
_INFERENCE = "megafab trains; Megatron's inference engine (text generation, dynamic batching, " \
    "CUDA-graph decoding) is not in megafab"
_RL = "Megatron's RL (GRPO) training is not in megafab"
_OTHER_MODELS = "megafab trains GPT models; Megatron's BERT, T5, ICT/REALM retrieval and biencoder " \
    "models are not in megafab"
_VISION = "megafab trains GPT models; Megatron's vision models (ViT, Swin, DINO) are not in megafab"
_FIM = f"fill-in-the-middle datasets are {NOT_YET}"
_SFT = f"Megatron's SFT dataset and prompt formats are {NOT_YET}"
_MUON = "the Muon optimizer is not in megafab (--optimizer adam or sgd)"
_WD = f"weight-decay schedules and per-parameter decay rules are {NOT_YET}: megafab decays every " \
    f"weight matrix by --weight-decay and no bias or norm weight (Megatron's default)"
_FP8 = f"this FP8/FP4 option is {NOT_YET}; --fp8-format / --fp8-recipe cover megafab's FP8"
_PRECISION = f"this precision option is {NOT_YET}; it would change the numbers"
_INIT = f"this initialization is {NOT_YET}; megafab draws normal(0, --init-method-std) weights " \
    f"(output projections scaled as Megatron's)"
_PIPELINE = f"this pipeline-parallel option is {NOT_YET}"
_DDP = f"this data-parallel bucket and reduction option is {NOT_YET}; it changes the gradient " \
    f"buffers' layout or rounding (megafab has --ddp-bucket-size)"
_CP = f"this context-parallel load balancing is {NOT_YET}"
_RERUN = f"Megatron's rerun state machine (re-running an iteration to tell a transient fault from a " \
    f"reproducible one) is {NOT_YET}; a nan or inf loss or gradient stops the run " \
    f"(--check-for-nan-in-loss-and-grad)"
_FT = "NVIDIA's fault-tolerance and in-process-restart packages are not in megafab; torchrun's " \
    "--max-restarts with --load/--save resumes a run"
_NV_LOGGING = "NVIDIA-internal telemetry (one-logger, app tags, energy, workload inspector) is not in megafab"
_LOGGING = f"this logging is {NOT_YET}"
_CKPT = f"this checkpointing option is {NOT_YET}"
_DATA = f"this dataset option is {NOT_YET}"
_TOKENIZER = f"this tokenizer option is {NOT_YET}"
_PROCESS_GROUPS = f"this process-group option is {NOT_YET}"
_VALIDATION = f"this validation mode is {NOT_YET}; megafab evaluates --eval-iters batches of the " \
    f"validation split"
_DETERMINISM = f"batch-invariant kernels are {NOT_YET}"
REFUSED.update({
    "--batch-size": Refused("removed in Megatron-LM, which stops on it; use --micro-batch-size"),
    "--warmup": Refused("removed in Megatron-LM, which stops on it; use --lr-warmup-fraction, "
                        "--lr-warmup-iters or --lr-warmup-samples"),
    "--model-parallel-size": Refused("removed in Megatron-LM, which stops on it; use "
                                     "--tensor-model-parallel-size"),
    "--checkpoint-activations": Refused(
        "removed in Megatron-LM, which stops on it; use --recompute-activations, or "
        "--recompute-granularity and --recompute-method"),
    "--exit-signal": Refused("megafab's --exit-signal-handler saves and exits on SIGTERM only",
                             off=("SIGTERM",)),
    "--rerun-mode": Refused(_RERUN, off=("disabled",), no_effect=(
        ("validate_results", "megafab has no rerun state machine: a nan or inf loss or gradient stops "
                             "the run with the iteration and ranks (--check-for-nan-in-loss-and-grad) "
                             "instead of re-running the iteration to classify the fault"),)),
    "--error-injection-rate": Refused(_RERUN, off=("0",)),
    "--cuda-graph-impl": Refused(_CUDA_GRAPHS, off=("none",)),
    "--cpu-offloading-num-layers": Refused(_OFFLOAD, off=("0",)),
    "--head-lr-mult": Refused(f"a learning-rate multiplier for a model head is {NOT_YET}",
                              off=("1", "1.0")),
    "--weight-decay-incr-style": Refused(_WD, off=("constant",)),
    "--main-grads-dtype": Refused(f"precision-aware optimizer dtypes other than fp32 are {NOT_YET}",
                                  off=("fp32",)),
    "--main-params-dtype": Refused(f"precision-aware optimizer dtypes other than fp32 are {NOT_YET}",
                                   off=("fp32",)),
    "--exp-avg-dtype": Refused(f"precision-aware optimizer dtypes other than fp32 are {NOT_YET}",
                               off=("fp32",)),
    "--exp-avg-sq-dtype": Refused(f"precision-aware optimizer dtypes other than fp32 are {NOT_YET}",
                                  off=("fp32",)),
    "--outer-dp-sharding-strategy": Refused(f"hybrid-sharded (HSDP) Megatron-FSDP; {FSDP}",
                                            off=("no_shard",)),
    "--dataloader-type": Refused(
        f"cyclic and external data loaders are {NOT_YET}; megafab's is Megatron's single-pass one",
        off=("single",)),
    "--vocab-extra-ids": Refused(_OTHER_MODELS, off=("0",)),
})

_refuse(_CUDA_GRAPHS, """--enable-cuda-graph --external-cuda-graph --cuda-graph-scope V+
    --cuda-graph-warmup-steps V --te-rng-tracker""")
_refuse(_OFFLOAD, """--fine-grained-activation-offloading --offload-modules V+
    --min-offloaded-tensor-size V""")
_refuse(_MLA, "--cache-mla-latents")
_refuse(_ATTENTION, """--attention-output-gate --experimental-attention-variant V --dsa-indexer-n-heads V
    --dsa-indexer-head-dim V --dsa-indexer-topk V --dsa-indexer-loss-coeff V
    --dsa-indexer-use-sparse-loss --qk-l2-norm --qk-clip
    --qk-clip-alpha V --qk-clip-threshold V --use-kitchen-attention --kitchen-attention-backend V
    --relative-attention-num-buckets V --relative-attention-max-distance V""")
_refuse(_ROPE, "--no-rope-freq V --mrope-section V+")
_refuse(_MAMBA, """--is-hybrid-model --mamba-state-dim V --mamba-head-dim V --mamba-num-groups V
    --mamba-num-heads V --disable-mamba-mem-eff-path --hybrid-attention-ratio V --hybrid-mlp-ratio V
    --hybrid-override-pattern V --linear-attention-freq V --linear-conv-kernel-dim V
    --linear-key-head-dim V --linear-value-head-dim V --linear-num-key-heads V
    --linear-num-value-heads V""")
_refuse(_HETERO, """--heterogeneous-layers-config-path V --heterogeneous-layers-config-encoded-json V""")
_refuse(_INFERENCE, """--flash-decode --decode-only-cuda-graphs --nccl-all-reduce-for-prefill
    --enable-chunked-prefill --disable-chunked-prefill --use-legacy-static-engine
    --inference-fuse-tp-communication --symmetric-ar-type V --max-tokens-to-oom V
    --inference-batch-times-seqlen-threshold V --mlp-chunks-for-prefill V --inference-coordinator-port V
    --inference-wandb-logging --no-inference-wandb-logging --inference-rng-tracker
    --inference-max-requests V --inference-max-seq-length V --inference-max-batch-size V
    --inference-dynamic-batching --inference-dynamic-batching-buffer-size-gb V
    --inference-dynamic-batching-paused-buffer-size-gb V --inference-dynamic-batching-block-size V
    --inference-dynamic-batching-max-requests V --inference-dynamic-batching-max-tokens V
    --inference-dynamic-batching-num-cuda-graphs V
    --inference-dynamic-batching-track-paused-request-events
    --inference-dynamic-batching-unified-memory-level V
    --inference-dynamic-batching-cuda-graph-max-tokens V
    --inference-dynamic-batching-cuda-graph-mixed-prefill-count V --inference-logging-step-interval V""")
_refuse(_RL, """--perform-rl-step --rl-prompts-per-eval V --grpo-prompts-per-step V --grpo-group-size V
    --grpo-iterations V --grpo-clamp-eps-lower V --grpo-clamp-eps-upper V --grpo-kl-beta V
    --grpo-entropy-term-weight V --grpo-filter-groups-with-same-reward --langrl-inference-server-type V
    --langrl-inference-server-conversation-template V --langrl-external-server
    --no-langrl-external-server --langrl-env-config V --rl-default-temperature V --rl-default-top-p V
    --rl-default-top-k V --rl-offload-optimizer-during-inference --rl-offload-kv-cache-during-training
    --no-rl-offload-kv-cache-during-training --rl-remove-kv-cache-during-training
    --no-rl-remove-kv-cache-during-training --rl-reset-cuda-graphs --no-rl-reset-cuda-graphs
    --rl-partial-rollouts --no-rl-partial-rollouts --rl-inference-logprobs-is-correction
    --no-rl-inference-logprobs-is-correction --rl-importance-sampling-truncation-coef V
    --rl-use-sequence-packing --no-rl-use-sequence-packing --rl-sequence-packing-max-sequences-per-bin V
    --rl-sequence-packing-algo V --rl-training-cuda-graphs --no-rl-training-cuda-graphs
    --rl-inference-tensor-model-parallel-size V --rl-inference-pipeline-model-parallel-size V
    --rl-inference-expert-model-parallel-size V --rl-inference-expert-tensor-model-parallel-size V
    --rl-inference-model-unified-memory-level V --rl-offload-inference-model-weights-when-idle
    --no-rl-offload-inference-model-weights-when-idle --refit-method V --rl-verify-model-weights-swap
    --no-rl-verify-model-weights-swap --rl-parallel-generation-tasks V --rl-skip-bos-token
    --no-rl-skip-bos-token""")
_refuse(_OTHER_MODELS, """--bert-no-binary-head --bert-embedder-type V --bert-load V
    --output-bert-embeddings --biencoder-projection-dim V --biencoder-shared-query-context-model
    --ict-head-size V --ict-load V --titles-data-path V --query-in-block-prob V --use-one-sent-docs
    --evidence-data-path V --retriever-report-topk-accuracies V+ --retriever-score-scaling
    --block-data-path V --embedding-path V --indexer-batch-size V --indexer-log-interval V --mask-prob V
    --short-seq-prob V --sample-rate V --decoder-seq-length V""")
_refuse(_VISION, """--num-classes V --img-h V --img-w V --num-channels V --patch-dim V --classes-fraction V
    --data-per-class-fraction V --no-data-sharding --vision-pretraining --vision-pretraining-type V
    --vision-backbone-type V --swin-backbone-type V --mask-type V --mask-factor V --iter-per-epoch V
    --dino-local-img-size V --dino-local-crops-number V --dino-head-hidden-size V
    --dino-bottleneck-size V --dino-freeze-last-layer V --dino-norm-last-layer
    --dino-warmup-teacher-temp V --dino-teacher-temp V --dino-warmup-teacher-temp-epochs V""")
_refuse(_FIM, """--fim-data --fim-rate V --fim-spm-rate V --fim-split-sample V --fim-fragment-rate V
    --fim-no-prefix V --fim-prefix-token V --fim-middle-token V --fim-suffix-token V --fim-pad-token V
    --fim-eod-token V""")
_refuse(_SFT, "--sft --sft-tokenizer-prompt-format V")
_refuse(_MUON, """--muon-momentum V --muon-no-split-qkv --muon-use-nesterov --muon-scale-mode V
    --muon-fp32-matmul-prec V --muon-num-ns-steps V --muon-tp-mode V --muon-extra-scale-factor V""")
_refuse(_WD, """--start-weight-decay V --end-weight-decay V --apply-wd-to-qk-layernorm
    --no-weight-decay-cond-type V""")
_refuse(_FP8, """--fp8-quantizer-factory V --no-fp8-wgrad --disable-fp8-wgrad --first-last-layers-bf16
    --num-layers-at-start-in-bf16 V --num-layers-at-end-in-bf16 V --fp4-format V --fp4-recipe V
    --fp4-param-gather --fp4-quantizer-factory V --te-precision-config-file V --keep-fp8-transpose-cache
    --reuse-grad-buf-for-mxfp8-param-ag""")
_refuse(_PRECISION, "--fp32-residual-connection --fp16-lm-cross-entropy")
_refuse("Megatron's ONNX-export workarounds are not in megafab", "--onnx-safe V")
_refuse(f"this activation function is {NOT_YET}",
        "--use-fused-weighted-squared-relu --use-te-activation-func")
_refuse(_INIT, """--embedding-init-method-std V --init-method-xavier-uniform --data-parallel-random-init""")
_refuse(_PIPELINE, """--use-ring-exchange-p2p
    --pipeline-model-parallel-comm-backend V""")
_refuse(f"MTP layers in a pipeline stage of their own are {NOT_YET} (megafab places them on the last "
        f"stage, as megatron-core without --mtp-standalone)", "--mtp-standalone")
_refuse(f"distributing recomputed activations over the model-parallel group is {NOT_YET}",
        "--distribute-saved-activations")
_refuse(_DDP, """--ddp-num-buckets V --ddp-pad-buckets-for-high-nccl-busbw
    --ddp-reduce-scatter-with-fp32-accumulation""")
_refuse(f"Megatron-FSDP sharding options; {FSDP}", "--enable-full-sharding-in-hsdp "
        "--suggested-communication-unit-size V")
_refuse(_CP, "--hybrid-context-parallel --max-seqlen-per-dp-cp-rank V")
_refuse(_RERUN, """--error-injection-type V --check-for-spiky-loss --check-for-large-grads
    --result-rejected-tracker-filename V""")
_refuse(_FT, """--enable-ft-package --calc-ft-timeouts --ft-num-warmup-iters V --inprocess-restart
    --inprocess-max-iterations V --inprocess-monitor-thread-interval V
    --inprocess-monitor-process-interval V --inprocess-progress-watchdog-interval V
    --inprocess-heartbeat-interval V --inprocess-soft-timeout V --inprocess-hard-timeout V
    --inprocess-heartbeat-timeout V --inprocess-barrier-timeout V --inprocess-completion-timeout V
    --inprocess-last-call-wait V --inprocess-termination-grace-time V --inprocess-granularity V
    --inprocess-active-world-size V --inprocess-empty-cuda-cache --adlr-autoresume
    --adlr-autoresume-interval V""")
_refuse(_NV_LOGGING, """--one-logger-project V --one-logger-run-name V --one-logger-async
    --app-tag-run-name V --app-tag-run-version V --log-energy --run-workload-inspector-server""")
_refuse(_LOGGING, """--log-memory-interval V --log-device-memory-used
    --log-max-attention-logit --log-straggler --straggler-ctrlr-port V --straggler-minmax-count V
    --config-logger-dir V --dump-param-to-param-group-map V --no-barrier-with-level-1-timing""")
_refuse(_CKPT, """--ckpt-convert-save V --ckpt-convert-update-legacy-dist-opt-format
    --dist-ckpt-save-pre-mcore-014 --distrib-optim-fully-reshardable-mem-efficient --replication
    --replication-jump V --replication-factor V --save-wgrads-interval V
    --save-dgrads-interval V --load-main-params-from-ckpt""")
_refuse(_DATA, """--data-args-path V --per-split-data-args-path V --per-dataset-sequences-path V
    --dataloader-fast-cache-load --dataloader-defer-npy-index-mmap --num-dataset-builder-threads V
    --object-storage-cache-path V --mid-level-dataset-surplus V --allow-ambiguous-pad-tokens
    --exit-signal-handler-for-dataloader""")
_refuse(_VALIDATION, "--full-validation --multiple-validation-sets")
_refuse(_TOKENIZER, """--tokenizer-metadata V --legacy-tokenizer --tokenizer-sentencepiece-legacy
    --tokenizer-hf-use-fast --tokenizer-hf-include-special-tokens""")
_refuse(_PROCESS_GROUPS, """--distributed-timeout-seconds-after-init V --lazy-mpu-init V?
    --fake-process-group --use-sharp --sharp-enabled-group V --nccl-communicator-config-path V""")
_refuse(_DETERMINISM, "--batch-invariant-mode")
_refuse(f"this training-loop option of Megatron's is {NOT_YET}", """--iterations-to-skip V+
    --phase-transition-iterations V --decrease-batch-size-if-needed --test-mode""")

# Flags accepted without effect (megatron_flags_no_effect.py): the listed ones, then each family.
NO_EFFECT: dict[str, str] = dict(no_effect_flags.LISTED)
for _reason, _spec in no_effect_flags.FAMILIES:
    NO_EFFECT.update(dict.fromkeys(_values(_spec), _reason))

# Megatron-LM HEAD's flags (megatron_flags_head.py): refused by family, then the no-effect ones
for _reason, _spec in head_flags.refused(sys.modules[__name__]):
    _refuse(_reason, _spec)
for _flag, _off in head_flags.OFF.items():
    REFUSED[_flag] = Refused(REFUSED[_flag].reason, off=_off)
NO_EFFECT.update(head_flags.NO_EFFECT_LISTED)
for _reason, _spec in head_flags.NO_EFFECT_FAMILIES:
    NO_EFFECT.update(dict.fromkeys(_values(_spec), _reason))
_values(head_flags.VALUED)
REFUSED_VALUES: dict[str, dict[str, str]] = head_flags.refused_values(sys.modules[__name__])

# The valued flags of REFUSED's entries above (the families' specs name their own). Flags of other Megatron-LM
# versions than 0.16.1: --retro-project-dir (older) takes one value.
_values("--retro-project-dir V")
_values("""--hierarchical-context-parallel-sizes V+ --moe-upcycling-granularity V
    --moe-flex-dispatcher-backend V --moe-deepep-num-sms V --moe-hybridep-num-sms V --moe-latent-size V
    --num-distributed-optimizer-instances V --spec V* --encoder-num-layers V
    --decoder-num-layers V --pipeline-model-parallel-layout V --ckpt-convert-format V --batch-size V
    --warmup V --model-parallel-size V --exit-signal V --rerun-mode V
    --error-injection-rate V --cuda-graph-impl V --cpu-offloading-num-layers V
    --head-lr-mult V --weight-decay-incr-style V
    --main-grads-dtype V --main-params-dtype V --exp-avg-dtype V --exp-avg-sq-dtype V
    --outer-dp-sharding-strategy V --dataloader-type V --vocab-extra-ids V""")
_values(no_effect_flags.VALUED)


def refused_problem(flag: str) -> str:
    return f"{flag}: refused, {REFUSED[flag].reason}; remove it (megafab never ignores a flag)"


def refused_value_problem(flag: str, value: str) -> str:
    return f"{flag} {value}: refused, {REFUSED_VALUES[flag][value]}; choose another value"
