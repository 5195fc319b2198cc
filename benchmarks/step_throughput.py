"""Single-rank training-step throughput: megafab vs a plain PyTorch GPT vs HF transformers' GPT-2.

    python benchmarks/step_throughput.py [--layers 4 --hidden 256 --heads 8 --seq 256 --batch 8
                                          --vocab 8192 --steps 3 --rounds 7 --threads 2 --compile]

The same GPT-2 shape (tied embeddings, learned positions, LayerNorm, GELU MLP, no dropout) three
ways, each stepping AdamW (lr 1e-4, wd 0.1, grad clip 1.0) on one fixed synthetic batch:

    megafab   build_model / build_optimizer / train_step (TP=PP=DP=1, one gloo rank): the real step,
              schedule, DDP grad buffer, finalize, clipping, fp32-main AdamW and LR schedule
    torch     nanoGPT-style model written below (nn.Linear, SDPA causal, F.cross_entropy, AdamW)
    hf        transformers GPT2LMHeadModel from a local GPT2Config (sdpa attention), same loss

Precisions: fp32; bf16 = for megafab its --bf16 (bf16 params and activations, fp32 main params and
grads, as Megatron), for torch/hf fp32 params under torch.autocast(bfloat16).

Runs are interleaved (round r: megafab, torch, hf, megafab+compile ...), each run `steps` steps after
warm-up; the table shows tokens/s median [min-max] over rounds and the ratio to torch computed per
round (both measured back to back), median [min-max]. Absolute numbers on a shared machine are
noise; the per-round ratios are what to read.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_util import (  # noqa: E402
    build_state,
    fmt_spread,
    gpt_flags,
    init_single_process,
    load_average,
    model_size_args,
    repeat_batch,
    synthetic_batch,
)
from megafab.optim.mixed_precision import make_torch_optimizer  # noqa: E402
from megafab.training.step import train_step  # noqa: E402


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(h)
        self.c_attn = nn.Linear(h, 3 * h)
        self.c_proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.c_fc = nn.Linear(h, 4 * h)
        self.mlp_proj = nn.Linear(4 * h, h)

    def forward(self, x):  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, s, h))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    """nanoGPT's shape: token + position embedding, pre-norm blocks, final norm, tied head."""

    def __init__(self, layers: int, h: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens):  # [b, s] -> logits [b, s, V]
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def adamw_for(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with megafab's groups (no decay on biases and 1-D params) and the same fused choice."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    return make_torch_optimizer("adam", [{"params": decay, "weight_decay": 0.1},
                                         {"params": plain, "weight_decay": 0.0}],
                                lr=1e-4, betas=(0.9, 0.999), eps=1e-8, sgd_momentum=0.0)


class TorchRunner:
    """One step of a plain module: forward under optional autocast, CE loss, backward, clip, AdamW."""

    def __init__(self, model: nn.Module, batch: dict, bf16: bool, logits_of=None):
        self.model, self.batch, self.bf16 = model, batch, bf16
        self.logits_of = logits_of or (lambda m, t: m(t))
        self.optimizer = adamw_for(model)

    def step(self):
        self.optimizer.zero_grad(set_to_none=True)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with autocast:
            logits = self.logits_of(self.model, self.batch["tokens"])
        loss = F.cross_entropy(logits.float().flatten(0, 1), self.batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return loss.item()


class MegafabRunner:
    def __init__(self, args, batch: dict, bf16: bool, compile_layers: bool):
        flags = gpt_flags(args.layers, args.hidden, args.heads, args.seq, args.batch, args.vocab)
        flags += ["--bf16"] if bf16 else []
        flags += ["--compile"] if compile_layers else []
        self.state = build_state(flags)
        self.data = repeat_batch(batch)

    def step(self):
        return train_step(self.state, self.data)["lm loss"]


def hf_runner(args, batch: dict, bf16: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config)
    model.train()
    return TorchRunner(model, batch, bf16, logits_of=lambda m, t: m(input_ids=t, use_cache=False).logits)


def make_runners(args, precision: str, batch: dict) -> dict:
    bf16 = precision == "bf16"
    runners = {}
    torch.manual_seed(0)
    for impl in args.impls.split(","):
        if impl == "megafab":
            runners["megafab"] = MegafabRunner(args, batch, bf16, compile_layers=False)
            if args.compile:
                runners["megafab+compile"] = MegafabRunner(args, batch, bf16, compile_layers=True)
        elif impl == "torch":
            runners["torch"] = TorchRunner(
                PlainGPT(args.layers, args.hidden, args.heads, args.seq, args.vocab), batch, bf16)
        elif impl == "hf":
            runners["hf"] = hf_runner(args, batch, bf16)
        else:
            raise SystemExit(f"--impls: unknown implementation {impl!r}; use megafab, torch, hf")
    return runners


def time_steps(runner, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        runner.step()
    return time.perf_counter() - start


def profile_runner(name: str, runner, steps: int, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_steps(runner, steps)
    print(f"\n--- torch.profiler, {name}, {steps} steps, by self CPU time ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def measure(args, precision: str) -> None:
    batch = synthetic_batch(args.batch, args.seq, args.vocab)
    runners = make_runners(args, precision, batch)
    for runner in runners.values():  # warm-up: allocator, fused kernels, compilation
        time_steps(runner, args.warmup)
    seconds = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            seconds[name].append(time_steps(runner, args.steps))
    tokens = args.batch * args.seq * args.steps
    baseline = seconds.get("torch")
    for name, times in seconds.items():
        tput = [tokens / t for t in times]
        ratio = fmt_spread([b / t for b, t in zip(baseline, times)], 2) if baseline else "-"
        print(f"{precision + ' ' + PRECISION_NOTE[name][precision == 'bf16']:<40}{name:<17}"
              f"{fmt_spread(tput):>24}{ratio:>24}")
    if args.profile:
        for name, runner in runners.items():
            profile_runner(f"{name} {precision}", runner, args.steps, args.profile)


PRECISION_NOTE = {
    "megafab": ("", "(bf16 params, fp32 main)"),
    "megafab+compile": ("", "(bf16 params, fp32 main)"),
    "torch": ("", "(fp32 params, autocast)"),
    "hf": ("", "(fp32 params, autocast)"),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_size_args(ap, layers=4, hidden=256, heads=8, seq=256, vocab=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation first")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median over them)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--impls", default="megafab,torch,hf")
    ap.add_argument("--compile", action="store_true",
                    help="add megafab with --compile (torch.compile per layer)")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="after timing, print torch.profiler's top ROWS ops per implementation")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    init_single_process()
    print(f"Step throughput, one rank: layers {args.layers}, hidden {args.hidden}, heads {args.heads}, "
          f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}; {args.steps} steps x {args.rounds} "
          f"interleaved rounds, {args.threads} threads, torch {torch.__version__}; {load_average()}")
    print(f"{'precision':<40}{'implementation':<17}{'tokens/s med [min-max]':>24}"
          f"{'vs torch med [min-max]':>24}")
    for precision in args.precisions.split(","):
        measure(args, precision)
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
