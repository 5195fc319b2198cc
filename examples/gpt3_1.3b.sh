#!/usr/bin/env bash
# GPT-3 XL (1.3B: 24 layers, hidden 2048, 16 heads, sequence 2048) on one node of 8 GPUs:
# tensor parallel 2 with sequence parallel x data parallel 4, distributed optimizer, bf16. GPT-3
# paper schedule: 1M-token batches, lr 2e-4 cosine to 2e-5 over 260B tokens, 300B tokens in all.
#
#   DATA_PATH=data/my_corpus_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt \
#       bash examples/gpt3_1.3b.sh [more Megatron flags, e.g. --train-iters 1000]
#
# Multi-node by hand: set NNODES, NODE_RANK and MASTER_ADDR on every node (or use slurm/).
# Check a change without GPUs: WORLD_SIZE=8 RANK=0 python pretrain_gpt.py <flags> --dry-run
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
DATA_PATH=${DATA_PATH:-data/my_corpus_text_document}   # PREFIX of PREFIX.bin/.idx (tools/preprocess_data.py)
VOCAB_FILE=${VOCAB_FILE:-data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-data/gpt2-merges.txt}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-runs/gpt3_1.3b/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-runs/gpt3_1.3b/tensorboard}

DISTRIBUTED_ARGS=(--nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
                  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
GPT_MODEL_ARGS=(
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16
    --seq-length 2048 --max-position-embeddings 2048
    --position-embedding-type learned_absolute --normalization LayerNorm
    --init-method-std 0.02 --hidden-dropout 0.0 --attention-dropout 0.0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 512
    --train-samples 146484375 --lr-decay-samples 126953125 --lr-warmup-samples 183105
    --recompute-activations
    --lr 2.0e-4 --min-lr 2.0e-5 --lr-decay-style cosine
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --bf16
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --split 949,50,1
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
)
OUTPUT_ARGS=(
    --log-interval 100 --log-throughput --tensorboard-dir "$TENSORBOARD_DIR"
    --eval-interval 1000 --eval-iters 10
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 2000
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
