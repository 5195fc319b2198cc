"""Megatron-LM's command line, parsed into megafab's Config.

Thin on purpose: flag names, types and defaults as Megatron's `megatron/training/arguments.py`;
every derivation and check lives in config.py. A Megatron flag megafab does not implement is
refused by name, never ignored.
"""

from __future__ import annotations

import argparse
import sys

from megafab.config import Config, ConfigError
from megafab.errors import MegafabError
from megafab.launch import read_launch_env

# Megatron flags megafab knows but does not implement. Values that mean "feature off" pass.
UNSUPPORTED = {
    "--context-parallel-size": "1",
    "--expert-model-parallel-size": "1",
    "--expert-tensor-parallel-size": None,
    "--num-experts": None,
    "--moe-router-topk": None,
    "--moe-grouped-gemm": None,
    "--multi-latent-attention": None,
    "--rampup-batch-size": None,
    "--decoder-first-pipeline-num-layers": None,
    "--decoder-last-pipeline-num-layers": None,
    "--account-for-embedding-in-pipeline-split": None,
    "--account-for-loss-in-pipeline-split": None,
    "--tp-comm-overlap": None,
    "--num-distributed-optimizer-instances": "1",
    "--yaml-cfg": None,
    "--spec": None,
    "--use-legacy-models": None,
    "--retro-project-dir": None,
    "--mtp-num-layers": None,
    "--apply-layernorm-1p": None,
    "--apply-residual-connection-post-layernorm": None,
    "--openai-gelu": None,
    "--squared-relu": None,
    "--qk-layernorm": None,
    "--calculate-per-token-loss": None,
    "--use-tp-pp-dp-mapping": None,
    "--encoder-num-layers": None,
    "--decoder-num-layers": None,
    "--fp8-param-gather": None,
    "--cpu-offloading": None,
    "--recompute-activations-offload": None,
    "--delay-wgrad-compute": None,
    "--check-for-nan-in-loss-and-grad": None,
}

# Megatron flags that are defaults in megafab (accepted, nothing to do).
ACCEPTED_NO_OPS = ["--use-mcore-models", "--use-flash-attn", "--no-masked-softmax-fusion",
                   "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                   "--no-async-tensor-model-parallel-allreduce", "--attention-softmax-in-fp32",
                   "--no-persist-layer-norm", "--bias-gelu-fusion", "--bias-swiglu-fusion",
                   "--masked-softmax-fusion", "--no-rope-fusion", "--use-checkpoint-opt_param-scheduler"]


class UnsupportedFlagError(MegafabError):
    pass


def _model_flags(p):
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--kv-channels", type=int)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated Megatron spelling of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                   help="default: local (transformer_engine needs TE and a GPU)")
    g.add_argument("--compile", action="store_true", dest="compile_layers",
                   help="megafab only, not a Megatron flag: torch.compile each transformer layer")
    r = p.add_argument_group("activation recompute")
    r.add_argument("--recompute-activations", action="store_true",
                   help="shortcut for --recompute-granularity selective")
    r.add_argument("--recompute-granularity", choices=["full", "selective"])
    r.add_argument("--recompute-method", choices=["uniform", "block"])
    r.add_argument("--recompute-num-layers", type=int)
    r.add_argument("--recompute-modules", nargs="*")


def _parallel_flags(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int)
    g.add_argument("--gradient-accumulation-fusion", action="store_true", default=True)
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", default=True)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def _sharding_and_offload_flags(p):
    g = p.add_argument_group("ZeRO-2/3 (FSDP) and optimizer CPU offload")
    g.add_argument("--use-torch-fsdp2", action="store_true")
    g.add_argument("--use-megatron-fsdp", "--use-custom-fsdp", action="store_true", dest="use_megatron_fsdp")
    g.add_argument("--data-parallel-sharding-strategy",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward")
    g.add_argument("--optimizer-cpu-offload", action="store_true")
    g.add_argument("--optimizer-offload-fraction", type=float)
    g.add_argument("--use-torch-optimizer-for-cpu-offload", action="store_true")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true")
    g.add_argument("--no-pin-cpu-grads", action="store_false", dest="pin_cpu_grads")
    g.add_argument("--no-pin-cpu-params", action="store_false", dest="pin_cpu_params")
    g.add_argument("--use-precision-aware-optimizer", action="store_true")


def _precision_flags(p):
    g = p.add_argument_group("precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"])
    g.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "mxfp8", "blockwise"])
    g.add_argument("--fp8-margin", type=int, default=0)
    g.add_argument("--fp8-amax-history-len", type=int, default=1)
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"])


def _optimizer_flags(p):
    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-decay-samples", type=int)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-samples", type=int)
    g.add_argument("--lr-wsd-decay-iters", type=int)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)


def _training_flags(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--train-samples", type=int)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--skip-train", action="store_true")
    g.add_argument("--exit-interval", type=int)
    g.add_argument("--exit-duration-in-mins", type=float)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--dry-run", action="store_true",
                   help="megafab: check the flags and print the memory/FLOPs plan, start nothing")


def _data_flags(p):
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*")
    g.add_argument("--split", default=None)
    g.add_argument("--train-data-path", nargs="*")
    g.add_argument("--valid-data-path", nargs="*")
    g.add_argument("--test-data-path", nargs="*")
    g.add_argument("--data-cache-path")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--tokenizer-type", choices=[
        "GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
        "HuggingFaceTokenizer", "NullTokenizer"])
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--num-workers", type=int, default=2)


def _checkpoint_flags(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--ckpt-format", default="torch_dist")


def _logging_flags(p):
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--tensorboard-dir")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--wandb-project", default="")
    g.add_argument("--wandb-exp-name", default="")
    g.add_argument("--wandb-save-dir", default="")


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Train a GPT with Megatron-style tensor, sequence, pipeline and data parallelism. "
                    "Flags are Megatron-LM's.")
    for add in (_model_flags, _parallel_flags, _precision_flags, _optimizer_flags, _training_flags,
                _data_flags, _checkpoint_flags, _logging_flags, _sharding_and_offload_flags):
        add(parser)
    for flag in ACCEPTED_NO_OPS:
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return parser


def refuse_unsupported(argv: list[str]) -> list[str]:
    """Refuse Megatron flags megafab does not implement, by name, before anything else runs.

    Returns argv without the unsupported flags that were given their "off" value.
    """
    refused, kept, skip = [], [], False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        name, _, inline = token.partition("=")
        if name not in UNSUPPORTED:
            kept.append(token)
            continue
        neutral = UNSUPPORTED[name]
        value = inline or (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "")
        if neutral is not None and value == neutral:
            skip = not inline
            continue
        refused.append(name)
    if refused:
        raise UnsupportedFlagError(
            "Megatron-LM flag(s) " + ", ".join(refused) + " not supported by megafab yet; remove "
            "them (megafab never ignores a flag silently)")
    return kept


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(refuse_unsupported(argv))
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"
    if args.transformer_impl is None:
        args.transformer_impl = "local"
    return args


def config_from_args(argv: list[str] | None = None, world_size: int | None = None) -> Config:
    """Parse, derive and validate. Raises ConfigError (all problems) or UnsupportedFlagError."""
    args = parse_args(argv)
    if world_size is None:
        world_size = read_launch_env().world_size
    return Config.from_flat(vars(args)).finalize(world_size)


def config_or_exit(argv: list[str] | None = None, world_size: int | None = None) -> Config:
    """config_from_args for entry points: a user mistake prints one message and exits 2."""
    try:
        return config_from_args(argv, world_size)
    except (ConfigError, UnsupportedFlagError) as err:
        print(f"megafab: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
