"""Activation memory per rank, measured next to the planner: bytes autograd saves for backward in one
micro-batch's forward, at TP 1/2/4 with and without sequence parallel, without recompute, with
selective and with full recompute, for a GPT-2-style and a Llama-style model.

    python benchmarks/activation_memory.py [--hidden 128 --heads 8 --seq 64 --batch 2 --bf16]

Measured on TP rank 0 (every rank holds the same amount) with torch's saved-tensor hooks, distinct
storages, parameters excluded (megafab.optim.memory.SavedActivations):
    per layer    (saved bytes with 4 layers - saved bytes with 2 layers) / 2
    whole        the 4-layer model: embedding, layers, final norm, output layer and loss
Planned: megafab.plan.planner with kernels="cpu" (PyTorch's CPU attention kernels):
layer_activation_bytes (a full-recompute layer keeps only its input) and StagePlan.forward_saved_bytes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_util import load_average  # noqa: E402
from megafab import checks
from megafab.config import Config  # noqa: E402
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed  # noqa: E402
from megafab.model.gpt import GPTModel, masked_mean_loss  # noqa: E402
from megafab.model.transformer import LayerContext  # noqa: E402
from megafab.optim.memory import SavedActivations  # noqa: E402
from megafab.plan.planner import BYTES, layer_activation_bytes, plan  # noqa: E402
from megafab.run.fork_ranks import run_ranks  # noqa: E402

STYLES = {
    "gpt2": dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                 untie_embeddings_and_output_weights=False, add_bias_linear=True),
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False,
                  group_query_attention=True),
}
RECOMPUTE = {"none": {}, "selective": {"recompute_granularity": "selective"},
             "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                      "recompute_num_layers": 1}}
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]


def config(args, style: str, recompute: str, tp: int, sp: bool, layers: int) -> Config:
    flat = dict(num_layers=layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                seq_length=args.seq, vocab_size=args.vocab, make_vocab_size_divisible_by=128,
                hidden_dropout=0.1, attention_dropout=0.1, micro_batch_size=args.batch, train_iters=1,
                lr=1e-4, mock_data=True, tensor_model_parallel_size=tp, sequence_parallel=sp,
                bf16=args.bf16, **STYLES[style], **RECOMPUTE[recompute])
    if style == "llama":
        flat["num_query_groups"] = args.heads // 2
    cfg = Config.from_flat(flat)
    checks.finalize(cfg, world_size=tp)
    return cfg


def _saved_bytes(rank, world, args, style, recompute, sp, layers):
    cfg = config(args, style, recompute, world, sp, layers)
    group = dist.new_group(list(range(world))) if world > 1 else None
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, rank, 0, "cpu", tracker)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    ctx = LayerContext(group, cfg.parallel.sequence_parallel, dtype, torch.device("cpu"), 1234, tracker)
    model = GPTModel(cfg.model, ctx)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    with SavedActivations(model.parameters()) as saved:
        loss = masked_mean_loss(model(tokens[:, :-1], labels=tokens[:, 1:]), torch.ones(args.batch, args.seq))
    loss.backward()
    return saved.bytes


def measure_row(args, style, recompute, tp, sp) -> dict:
    whole = {n: max(run_ranks(_saved_bytes, tp, args, style, recompute, sp, n, timeout=args.timeout))
             for n in (2, 4)}
    cfg = config(args, style, recompute, tp, sp, 4)
    if recompute == "full":
        e = BYTES[cfg.precision.params_dtype_name]
        r = tp if cfg.parallel.sequence_parallel else 1
        planned_layer = e * args.seq * args.batch * args.hidden // r  # a recomputed layer keeps its input
    else:
        planned_layer = layer_activation_bytes(cfg, "cpu", recompute_core_attention=recompute == "selective")
    return {"layer": (whole[4] - whole[2]) / 2, "whole": whole[4], "planned_layer": planned_layer,
            "planned_whole": plan(cfg, kernels="cpu")[0].forward_saved_bytes}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--styles", nargs="*", default=list(STYLES))
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    kib = 1024.0
    print(f"Saved activation bytes per rank, {'bf16' if args.bf16 else 'fp32'}, dropout 0.1: hidden "
          f"{args.hidden}, heads {args.heads}, seq {args.seq}, micro-batch {args.batch}, vocab {args.vocab}; "
          f"KiB; planner kernels=cpu; {load_average()}")
    print(f"{'model':<7}{'recompute':<11}{'layout':<10}{'layer':>9}{'planned':>9}{'ratio':>7}"
          f"{'whole':>10}{'planned':>10}{'ratio':>7}{'vs TP1/t':>9}")
    for style in args.styles:
        for recompute in RECOMPUTE:
            single = None
            for tp, sp in LAYOUTS:
                row = measure_row(args, style, recompute, tp, sp)
                single = single or row["whole"]
                layout = f"TP{tp}" + (" SP" if sp else "")
                print(f"{style:<7}{recompute:<11}{layout:<10}{row['layer'] / kib:>9.1f}"
                      f"{row['planned_layer'] / kib:>9.1f}{row['planned_layer'] / row['layer']:>7.3f}"
                      f"{row['whole'] / kib:>10.1f}{row['planned_whole'] / kib:>10.1f}"
                      f"{row['planned_whole'] / row['whole']:>7.3f}{row['whole'] / (single / tp):>9.3f}",
                      flush=True)
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
