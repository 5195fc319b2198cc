#!/usr/bin/env bash
# The GPU checks of issue 13, as one short script for a lent GPU machine (about 5 minutes on an H200):
#   1. TP + SP layers through the linear core on NCCL (parity, saved bytes, speed) on every visible GPU
#      (with one GPU it checks the one-rank fused path; TP needs two or more GPUs)
#   2. the 1.3B bf16 single-GPU driver check; its MFU must not fall below the 46.0% recorded in
#      benchmarks/results/local.json
# Results land in ${OUT:-benchmarks/results}.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
mkdir -p "$out"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
CUDA_DEVICE_MAX_CONNECTIONS=1 python -m torch.distributed.run --nproc-per-node "$gpus" \
    benchmarks/gpu_tp_check.py | tee "$out/tp_check.log"
python benchmarks/gpu_check.py --out "$out/local_after.json" | tee "$out/local_after.log"
python - "$out/local_after.json" <<'PY'
import json, sys
mfu = json.load(open(sys.argv[1]))["local"]["mfu"]
print(f"MFU {100 * mfu:.1f}% (recorded before: 46.0%)")
sys.exit(0 if round(100 * mfu, 1) >= 46.0 else 1)
PY
