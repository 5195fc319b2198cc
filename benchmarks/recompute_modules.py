"""--recompute-granularity selective --recompute-modules, module by module, on a DeepSeek-style model
(Llama-style layers, a dense first layer, then MoE layers: routed experts top-2 with sigmoid scores,
grouped GEMM, a shared expert): the bytes autograd saves for backward in one micro-batch's forward
(measured with saved-tensor hooks, megafab.optim.memory.SavedActivations) next to the planner's
(StagePlan.forward_saved_bytes, kernels="cpu", balanced routing), and the forward + backward time
of one micro-batch relative to no recompute (median of --rounds).

    python benchmarks/recompute_modules.py [--hidden 256 --heads 8 --seq 256 --batch 2 --bf16]
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
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed  # noqa: E402
from megafab.model.gpt import GPTModel, masked_mean_loss  # noqa: E402
from megafab.model.transformer import LayerContext  # noqa: E402
from megafab.optim.memory import SavedActivations  # noqa: E402
from megafab.plan.planner import plan  # noqa: E402

MODULES = ["none", "core_attn", "layernorm", "mlp", "moe", "shared_experts", "moe_act",
           "layernorm mlp moe", "all"]
ALL = ["core_attn", "layernorm", "mlp", "moe", "shared_experts", "moe_act"]


def config(args, modules: str) -> Config:
    chosen = ALL if modules == "all" else modules.split()
    flat = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                num_query_groups=args.heads // 2, group_query_attention=True, seq_length=args.seq,
                vocab_size=args.vocab, make_vocab_size_divisible_by=128, hidden_dropout=0.0,
                attention_dropout=0.0, micro_batch_size=args.batch, train_iters=1, lr=1e-4, mock_data=True,
                bf16=args.bf16, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                untie_embeddings_and_output_weights=True, add_bias_linear=False, num_experts=args.experts,
                moe_router_topk=2, moe_layer_freq=[0] + [1] * (args.layers - 1),
                moe_router_score_function="sigmoid", moe_ffn_hidden_size=args.hidden,
                moe_shared_expert_intermediate_size=args.hidden, moe_grouped_gemm=True)
    if modules != "none":
        flat.update(recompute_granularity="selective", recompute_modules=chosen)
    cfg = Config.from_flat(flat)
    checks.finalize(cfg, world_size=1)
    return cfg


def measure(args, modules: str) -> tuple[int, int, list[float]]:
    cfg = config(args, modules)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, 0, 0, "cpu", tracker)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = GPTModel(cfg.model, LayerContext(None, False, dtype, torch.device("cpu"), 1234, tracker,
                                             moe=cfg.moe))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    mask = torch.ones(args.batch, args.seq)

    def step():
        return masked_mean_loss(model(tokens[:, :-1], labels=tokens[:, 1:]), mask)

    with SavedActivations(model.parameters()) as saved:
        loss = step()
    loss.float().backward()
    for _ in range(args.warmup):
        step().float().backward()
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        step().float().backward()
        times.append(time.perf_counter() - start)
    planned = plan(cfg, kernels="cpu", routing="balanced")[0].forward_saved_bytes
    return saved.bytes, planned, times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"Selective recompute by module, {'bf16' if args.bf16 else 'fp32'}: {args.layers} layers (1 dense, "
          f"{args.layers - 1} MoE: {args.experts} experts top-2 + shared), hidden {args.hidden}, heads "
          f"{args.heads}, seq {args.seq}, micro-batch {args.batch}; KiB; {load_average()}")
    print(f"{'modules':<22}{'saved':>10}{'planned':>10}{'ratio':>7}{'vs none':>9}{'fwd+bwd ms':>12}"
          f"{'time':>7}")
    base_saved = base_time = None
    for modules in MODULES:
        saved, planned, times = measure(args, modules)
        ms = median_spread(times)[0] * 1e3
        base_saved, base_time = base_saved or saved, base_time or ms
        print(f"{modules:<22}{saved / 1024:>10.1f}{planned / 1024:>10.1f}{planned / saved:>7.3f}"
              f"{saved / base_saved:>9.3f}{ms:>12.1f}{ms / base_time:>7.2f}", flush=True)
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
