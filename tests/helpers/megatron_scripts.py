"""Megatron-LM's example launch scripts as the argument lists they hand pretrain_gpt.py (the launch
script tests and the shrunk Mixtral run)."""


def words(text: str) -> list[str]:
    """A script's argument list as bash hands it over (its arrays are expanded unquoted)."""
    return text.split()


def fill(flags, paths):
    return [a.format(**paths) if "{" in a else a for a in flags]


# examples/gpt3/train_gpt3_175b_distributed.sh at core_v0.16.1 and on main (Megatron-LM HEAD)
GPT3_175B_MODEL = words("""
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
    --max-position-embeddings 2048 --attention-backend auto""")
GPT3_175B_REST = words("""
    --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006
    --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001
    --lr-decay-iters 430000
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    --data-path {data} --vocab-file {vocab} --merge-file {merges} --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --save {ckpt} --load {ckpt} --eval-iters 10
    --tensorboard-dir {tb}""")
GPT3_175B_CORE_0_16_1 = GPT3_175B_MODEL + words(
    "--micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375") + GPT3_175B_REST
GPT3_175B_MAIN = GPT3_175B_MODEL + words("""
    --micro-batch-size 1 --global-batch-size 1536
    --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
""".replace('"', "")) + GPT3_175B_REST  # the quoted schedule is split into words by the expansion

MIXTRAL_8X7B = words("""
    --use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
    --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope
    --swiglu --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8
    --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
    --tokenizer-type Llama2Tokenizer --tokenizer-model {spm} --data-path {data} --split 99990,8,2
    --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
    --use-distributed-optimizer --sequence-parallel
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save {ckpt} --load {ckpt}
    --tensorboard-dir {tb} --no-load-optim --no-load-rng""")


def script_flags(path: str, env: dict[str, str]) -> list[str]:
    """The arguments a fixture script hands pretrain_gpt.py, expanded by bash itself: an sbatch
    script's PRETRAIN_ARGS (its blocks up to the profiling one, env deciding which run), a modelopt
    bundle's MODEL_ARGS (sourced, split into words as its unquoted use splits them)."""
    import os
    import subprocess

    text = open(path, encoding="utf-8").read()
    if "PRETRAIN_ARGS=(" in text:
        body = text[:text.index("TRAINING_CMD=")] + '\nprintf "%s\\n" "${PRETRAIN_ARGS[@]}"\n'
    else:
        body = text + '\nprintf "%s\\n" $MODEL_ARGS\n'
    out = subprocess.run(["bash", "-c", body], capture_output=True, text=True, check=True, timeout=30,
                         env={**os.environ, **env})
    return out.stdout.split()


def launch_script_flags(path: str, script_args: list[str], workdir: str,
                        env: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """A script that launches `python -m torch.distributed.run ... pretrain_gpt.py ARGS` (or `torchrun
    ... pretrain_gpt.py ARGS`) itself (examples/gptoss/02_train.sh), run by bash in `workdir` (given
    the pretrain_gpt.py it looks for) with its own `script_args`, `env` added to the environment, and
    a `python` and a `torchrun` on PATH that print their arguments instead of running:
    (torch.distributed.run's arguments, pretrain_gpt.py's), as bash expands them."""
    import os
    import stat
    import subprocess

    shim = os.path.join(workdir, "bin")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, "python"), "w") as f:
        f.write('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    with open(os.path.join(shim, "torchrun"), "w") as f:
        f.write('#!/bin/bash\nprintf "%s\\n" torch.distributed.run "$@"\n')
    for name in ("python", "torchrun"):
        os.chmod(os.path.join(shim, name), stat.S_IRWXU)
    open(os.path.join(workdir, "pretrain_gpt.py"), "w").close()
    env = {**os.environ, **(env or {}), "PATH": f"{shim}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", path, *script_args], capture_output=True, text=True, check=True, timeout=30,
                         cwd=workdir, env=env)
    words = out.stdout.split("\n")
    start = words.index("torch.distributed.run")
    split = words.index("pretrain_gpt.py")
    return words[start + 1:split], [w for w in words[split + 1:] if w]
