#!/usr/bin/env bash
# Llama-2-7B shape (32 layers, hidden 4096, SwiGLU 11008, 32 heads, RoPE, RMSNorm, untied output,
# no biases, sequence 4096) on one node of 8 GPUs: tensor parallel 2 + sequence parallel x
# pipeline parallel 2 (2 virtual stages per rank, interleaved 1F1B) x data parallel 2, distributed
# optimizer, selective recompute, bf16. 4M-token batches, lr 3e-4 cosine to 3e-5 with 2000 warmup steps.
# Fits 8 x 80 GB; on more nodes keep TP inside a node and let data parallel grow.
#
#   DATA_PATH=data/my_corpus_text_document TOKENIZER_MODEL=tokenizer.model bash examples/llama_7b.sh \
#       [more Megatron flags, e.g. --train-iters 1000]
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
TOKENIZER_MODEL=${TOKENIZER_MODEL:-data/llama2-tokenizer.model}   # SentencePiece model, 32000 tokens
CHECKPOINT_PATH=${CHECKPOINT_PATH:-runs/llama_7b/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-runs/llama_7b/tensorboard}
TRAIN_ITERS=${TRAIN_ITERS:-500000}   # 2T tokens at 4M tokens per step

DISTRIBUTED_ARGS=(--nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
                  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
GPT_MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
    --seq-length 4096 --max-position-embeddings 4096
    --position-embedding-type rope --rotary-base 10000
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
    --untie-embeddings-and-output-weights --disable-bias-linear
    --init-method-std 0.02 --hidden-dropout 0.0 --attention-dropout 0.0
    --make-vocab-size-divisible-by 128
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --sequence-parallel
    --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 8
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 1024 --train-iters "$TRAIN_ITERS"
    --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
    --recompute-activations
    --bf16
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --split 990,8,2
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
)
OUTPUT_ARGS=(
    --log-interval 10 --log-throughput --tensorboard-dir "$TENSORBOARD_DIR"
    --eval-interval 1000 --eval-iters 10
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 1000
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
