"""Multi-token prediction's cost per depth (--mtp-num-layers 0, 1, 2) on a Llama-style GPT: the
forward + backward time of one micro-batch (median of --rounds), the bytes autograd saves for
backward (megafab.optim.memory.SavedActivations) next to the planner's (StagePlan.forward_saved_bytes,
kernels="cpu") and the model FLOPs (megafab.plan.flops), each as the increase per depth over no MTP
and as a fraction of the model without it.

    python benchmarks/mtp.py [--layers 4 --hidden 256 --heads 8 --seq 256 --batch 2 --rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_util import load_average, median_spread  # noqa: E402
from megafab import checks  # noqa: E402
from megafab.config import Config  # noqa: E402
from megafab.model.gpt import GPTModel, masked_mean_loss  # noqa: E402
from megafab.model.transformer import LayerContext  # noqa: E402
from megafab.optim.memory import SavedActivations  # noqa: E402
from megafab.plan.flops import flops_per_iteration  # noqa: E402
from megafab.plan.planner import plan  # noqa: E402


def config(args, depths: int) -> Config:
    flat = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                num_query_groups=args.heads // 2, group_query_attention=True, seq_length=args.seq,
                vocab_size=args.vocab, make_vocab_size_divisible_by=128, hidden_dropout=0.0,
                attention_dropout=0.0, micro_batch_size=args.batch, train_iters=1, lr=1e-4, mock_data=True,
                position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                untie_embeddings_and_output_weights=True, add_bias_linear=False,
                mtp_num_layers=depths or None)
    cfg = Config.from_flat(flat)
    checks.finalize(cfg, world_size=1)
    return cfg


def measure(args, depths: int) -> tuple[int, int, float, list[float]]:
    cfg = config(args, depths)
    model = GPTModel(cfg.model, LayerContext(None, False, torch.float32, torch.device("cpu"), 1234))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mask = torch.ones(args.batch, args.seq)

    def step():
        loss = masked_mean_loss(model(inputs, labels=labels, loss_mask=mask), mask)
        loss.backward()
        return loss

    with SavedActivations(model.parameters()) as saved:
        loss = masked_mean_loss(model(inputs, labels=labels, loss_mask=mask), mask)
    loss.backward()
    measured = saved.bytes
    planned = plan(cfg, kernels="cpu")[-1].forward_saved_bytes
    step()  # warm-up (first-call costs)
    times = []
    for _ in range(args.rounds):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return measured, planned, flops_per_iteration(cfg, args.batch), times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{load_average()}; {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"vocab {args.vocab}, batch {args.batch}, float32, {torch.get_num_threads()} threads")
    results = {d: measure(args, d) for d in args.depths}
    base = results[args.depths[0]]
    base_time = median_spread(base[3])[0]
    print(f"{'MTP depths':>10} {'fwd+bwd ms':>11} {'saved MiB':>10} {'planned MiB':>12} {'GFLOP':>8}"
          f" {'time/depth':>11} {'saved/depth':>12} {'FLOPs/depth':>12}")
    for d, (measured, planned, flops, times) in results.items():
        t = median_spread(times)[0]
        per = max(d - args.depths[0], 1)
        mib = 2**20
        print(f"{d:>10} {1e3 * t:>11.1f} {measured / mib:>10.2f} {planned / mib:>12.2f} {flops / 1e9:>8.2f}"
              f" {(t - base_time) / base_time / per:>11.1%} {(measured - base[0]) / base[0] / per:>12.1%}"
              f" {(flops - base[2]) / base[2] / per:>12.1%}")


if __name__ == "__main__":
    main()
