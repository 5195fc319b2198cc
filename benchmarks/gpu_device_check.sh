#!/usr/bin/env bash
# The GPU checks of issue 26 as one script for a lent GPU machine (about 7-9 minutes on one H200;
# each step has its own time limit, and a failing step is reported without stopping the others):
#   1. FSDP2 build peak memory: benchmarks/memory.py --sharding (the FSDP2 helper's benchmark; the
#      step says "skipped" if this checkout's memory.py has no --sharding)
#   2. --overlap-param-gather visible in a torch.profiler trace (benchmarks/gpu_overlap_trace.py;
#      needs 2+ GPUs: NCCL takes one rank per GPU, so on one GPU it reports "skipped")
#   3. CP attention on the fused CUDA kernels: parity vs the portable reference, no host-device sync
#      (torch.cuda.set_sync_debug_mode), time fused vs reference vs CP-1 SDPA and TE if installed
#      (benchmarks/gpu_cp_check.py)
#   4. FP8 loss curve vs bf16 (benchmarks/gpu_fp8_curve.py; TE rows "skipped" without TE)
#   5. Transformer Engine layers (issue 37): TE's dense layer equals the local one, and megafab's layer
#      around TE's linears/attention (MLA, MoE + shared experts, --qk-layernorm, MTP) equals the local
#      model on the GPU (tests/model/test_te.py, test_te_wrap.py; "skipped" without TE)
#   6. --async-save (issue 40) on the device: the host staging arena pinned with cudaHostRegister, the
#      writer process, a resume from the async checkpoint (pretrain_gpt.py with mock data, 1 rank)
#   7. Transformer Engine as a peer path (issue 39): TE's layers under selective recompute of each module
#      (fp32; FP8 through te.checkpoint on compute capability >= 8.9), FSDP2 (+ FP8) vs DDP over every
#      GPU, CP over every GPU with p2p / allgather / a2a (2+ GPUs; "skipped" on one)
#      (tests/model/gpu_check_te_combinations.py; "skipped" without TE; on cpu: the TE stand-in, gloo)
#   8. FP8 weights (--fp8-param-gather, UNVERIFIED until this step passes on a GPU with TE): a llama-like
#      tiny model, --fp8-format hybrid, the distributed optimizer with --overlap-param-gather over every
#      GPU, 3 iterations saved, then resumed to 6; the same with --use-torch-fsdp2 (pretrain_gpt.py,
#      mock data; "skipped" without TE; on cpu: tests/optim/test_fp8_param_gather.py, the TE stand-in)
#   all: then issue 13's checks (TP layers on NCCL, the 1.3B MFU check), about 5 minutes more.
# Results land in ${OUT:-benchmarks/results} (one .log per step, .json where the step writes one);
# the last lines list each step's exit status.
#
#   bash benchmarks/gpu_device_check.sh [all]
#   DEVICE=cpu bash benchmarks/gpu_device_check.sh    # the CPU-safe parts at tiny sizes (no GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
device=${DEVICE:-cuda}
mkdir -p "$out"
declare -a summary=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log, record status
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T), limit ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local status=${PIPESTATUS[0]}
    summary+=("$name: exit $status")
}

gpus=0
if [ "$device" = cuda ]; then
    gpus=$(python -c "import torch; print(torch.cuda.device_count())")
fi

# 1. FSDP2 build peak memory (the FSDP2 helper's benchmark; tolerated absent; on CPU it is a
#    benchmark of its own, not run here)
if [ "$device" != cuda ]; then
    echo "== fsdp_memory: skipped on cpu (run benchmarks/memory.py --sharding itself)"
    summary+=("fsdp_memory: skipped (cpu)")
elif python benchmarks/memory.py --help 2>/dev/null | grep -q -- "--sharding"; then
    step fsdp_memory 150 python benchmarks/memory.py --sharding
else
    echo "== fsdp_memory: skipped: benchmarks/memory.py has no --sharding in this checkout"
    summary+=("fsdp_memory: skipped")
fi

# 2. overlap of the parameter all-gathers in a profiler trace
if [ "$gpus" -ge 2 ]; then
    step overlap_trace 180 python -m torch.distributed.run --nproc-per-node "$gpus" \
        benchmarks/gpu_overlap_trace.py --out-dir "$out/overlap"
else
    echo "== overlap_trace: skipped: needs 2+ GPUs (found $gpus)"
    summary+=("overlap_trace: skipped ($gpus GPU)")
fi

# 3. CP on fused kernels
if [ "$device" = cuda ]; then
    step cp_check 180 python benchmarks/gpu_cp_check.py --out "$out/cp_check.json"
else
    step cp_check 180 python benchmarks/gpu_cp_check.py --device cpu --dtype fp32 --seq 512 --heads 4 \
        --groups 2 --dim 16 --parity-seq 64 --repeats 2 --out "$out/cp_check_cpu.json"
fi

# 4. FP8 loss curve vs bf16
if [ "$device" = cuda ]; then
    step fp8_curve 240 python benchmarks/gpu_fp8_curve.py --out "$out/fp8_curve.json"
else
    step fp8_curve 120 python benchmarks/gpu_fp8_curve.py --tiny --device cpu --steps 3 --every 1 \
        --out "$out/fp8_curve_cpu.json"
fi

# 5. Transformer Engine layers (dense, and MLA / MoE / qk-norm / MTP around TE's modules)
if [ "$device" = cuda ] && python -c "import transformer_engine.pytorch" 2>/dev/null; then
    step te_layers 240 python -m pytest -q -p no:cacheprovider tests/model/test_te.py tests/model/test_te_wrap.py
else
    echo "== te_layers: skipped: needs CUDA and transformer_engine"
    summary+=("te_layers: skipped")
fi

# 6. --async-save: train 4 iterations saving every 2 in the background, resume to 6 from iteration 4
async_flags="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
    --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 2 --mock-data \
    --tokenizer-type NullTokenizer --vocab-size 127 --lr 1e-3 --lr-decay-iters 6 --log-interval 1 --save-interval 2 \
    --async-save --use-persistent-ckpt-worker --save $out/async_ckpt"
rm -rf "$out/async_ckpt"
step async_save 240 bash -c "python pretrain_gpt.py $async_flags --train-iters 4 && \
    python pretrain_gpt.py $async_flags --train-iters 6 --load $out/async_ckpt | tee /dev/stderr | \
    grep -q 'loaded checkpoint from .* at iteration 4'"

# 7. Transformer Engine with recompute, FSDP2 and CP (one rank per GPU)
te_check="-m torch.distributed.run --nproc-per-node"
if [ "$device" = cuda ] && python -c "import transformer_engine.pytorch" 2>/dev/null; then
    step te_combinations 150 python $te_check "$gpus" -m tests.model.gpu_check_te_combinations
elif [ "$device" = cuda ]; then
    echo "== te_combinations: skipped: needs transformer_engine"
    summary+=("te_combinations: skipped")
else
    OMP_NUM_THREADS=1 step te_combinations 150 python $te_check 2 -m tests.model.gpu_check_te_combinations \
        --device cpu --fake-te
fi

# 8. FP8 weights with the distributed optimizer (overlapped gather), then a resume
fp8_flags="--num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention \
    --num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
    --untie-embeddings-and-output-weights --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 \
    --global-batch-size $((2 * (gpus > 0 ? gpus : 1))) --mock-data --tokenizer-type NullTokenizer \
    --vocab-size 127 --lr 1e-3 --lr-decay-iters 6 --log-interval 1 --bf16 --transformer-impl transformer_engine \
    --fp8-format hybrid --fp8-param-gather --save-interval 3"
fp8_dist="--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --save $out/fp8_ckpt"
fp8_fsdp="--use-torch-fsdp2 --save $out/fp8_fsdp_ckpt"
if [ "$device" = cuda ] && python -c "import transformer_engine.pytorch" 2>/dev/null; then
    rm -rf "$out/fp8_ckpt" "$out/fp8_fsdp_ckpt"
    for how in fp8_dist fp8_fsdp; do
        flags="$fp8_flags ${!how}"
        ckpt=${flags##*--save }
        # the resume's own exit status counts (pipefail), and grep reads its log once it has ended
        resumed="$out/fp8_param_gather_${how#fp8_}_resume.out"
        step "fp8_param_gather_${how#fp8_}" 240 bash -c "set -o pipefail; python $te_check $gpus pretrain_gpt.py \
            $flags --train-iters 3 && python $te_check $gpus pretrain_gpt.py $flags --train-iters 6 --load $ckpt \
            2>&1 | tee $resumed && grep -q 'loaded checkpoint from .* at iteration 3' $resumed"
    done
elif [ "$device" = cuda ]; then
    echo "== fp8_param_gather: skipped: needs transformer_engine"
    summary+=("fp8_param_gather: skipped")
else
    step fp8_param_gather 150 python -m pytest -q -p no:cacheprovider tests/optim/test_fp8_param_gather.py
fi

# issue 13's checks, on request
if [ "${1:-}" = all ] && [ "$device" = cuda ]; then
    CUDA_DEVICE_MAX_CONNECTIONS=1 step tp_check 180 python -m torch.distributed.run \
        --nproc-per-node "$gpus" benchmarks/gpu_tp_check.py
    step mfu_check 180 python benchmarks/gpu_check.py --out "$out/local_after.json"
fi

echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$out/device_check_summary.txt"
