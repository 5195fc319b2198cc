"""Multi-latent attention (DeepSeek-V3's layer in small: query LoRA, latent norms, YaRN), one CPU
process, float32:

  speed   forward + backward of megafab's MLASelfAttention against megatron-core 0.16.1's (local
          spec, benchmarks/mcore_mla_cpu.py's CPU shims; both call PyTorch SDPA for core attention),
          the same shapes and weights (outputs compared), median of --rounds taken alternately (the
          rotary angles computed once outside: GPTModel shares them, megatron-core caches them);
          ratio = megatron-core's time / megafab's (above 1: megafab faster).
  memory  the bytes autograd keeps for backward in one forward of megafab's layer (saved-tensor hooks,
          megafab.optim.memory.SavedActivations; the weights, the layer input and the rotary angles
          left out) with --recompute-modules none / core_attn / mla_up_proj / both, next to the
          planner's (plan/mla_activations.py, kernels="cpu"), and the forward + backward time of each.

    python benchmarks/mla.py [--hidden 512 --heads 8 --seq 512 --batch 2 --rounds 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_util import load_average, median_spread  # noqa: E402
from megafab import checks  # noqa: E402
from megafab.config import Config  # noqa: E402
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed  # noqa: E402
from megafab.model.mla import MLASelfAttention  # noqa: E402
from megafab.model.rotary import RotaryEmbedding  # noqa: E402
from megafab.model.transformer import LayerContext  # noqa: E402
from megafab.optim.memory import SavedActivations  # noqa: E402
from megafab.plan.mla_activations import mla_attention_bytes  # noqa: E402

RECOMPUTE = ["none", "core_attn", "mla_up_proj", "core_attn mla_up_proj"]


def config(args, modules: str = "none") -> Config:
    """DeepSeek-V3's MLA proportions at --hidden (q LoRA 3/8 h, kv LoRA h/8, qk = v = h/heads, pe half)."""
    head = args.hidden // args.heads
    flat = dict(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads, seq_length=args.seq,
                max_position_embeddings=args.seq, vocab_size=128, micro_batch_size=args.batch,
                hidden_dropout=0.0, attention_dropout=0.0, train_iters=1, lr=1e-4, mock_data=True,
                position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                untie_embeddings_and_output_weights=True, add_bias_linear=False, multi_latent_attention=True,
                qk_layernorm=True, q_lora_rank=3 * args.hidden // 8, kv_lora_rank=args.hidden // 8,
                qk_head_dim=head, qk_pos_emb_head_dim=head // 2, v_head_dim=head, rope_type="yarn",
                rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    if modules != "none":
        flat.update(recompute_granularity="selective", recompute_modules=modules.split())
    cfg = Config.from_flat(flat)
    checks.finalize(cfg, world_size=1)
    return cfg


def megafab_layer(cfg) -> MLASelfAttention:
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, 0, 0, "cpu", tracker)
    ctx = LayerContext(None, False, torch.float32, torch.device("cpu"), 1234, tracker)
    return MLASelfAttention(cfg.model, ctx, "decoder.layers.0.self_attention.")


def inputs(args, cfg):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(args.seq, args.batch, args.hidden, generator=g)
    rotary = RotaryEmbedding.from_model_config(cfg.model, torch.device("cpu"))
    return x, rotary, torch.arange(args.seq).expand(args.batch, -1)


def speed(args) -> None:
    try:
        with warnings.catch_warnings():  # megatron-core's notes that TE and Apex are absent
            warnings.simplefilter("ignore")
            import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

        from benchmarks.mcore_mla_cpu import copy_weights, megatron_mla, megatron_on_cpu, megatron_step
    except ImportError as e:
        print(f"speed: megatron-core is not installed ({e}); skipped")
        return
    from benchmarks.bench_util import init_single_process

    init_single_process()
    cfg = config(args)
    x, rotary, positions = inputs(args, cfg)
    grad = torch.linspace(-1, 1, x.numel()).view_as(x)
    with megatron_on_cpu():
        theirs = megatron_mla(cfg.model)
        ours = megafab_layer(cfg)
        copy_weights(theirs, ours)
        angles = rotary(positions, x.dtype)  # once per forward for every layer (megatron-core caches)

        def ours_step():
            out = ours(x.requires_grad_(True), angles)
            out.backward(grad)
            return out

        def theirs_step():
            out = megatron_step(theirs, x.requires_grad_(True))
            out.backward(grad)
            return out

        diff = (ours_step() - theirs_step()).abs().max().item()
        times = {"megafab": [], "megatron-core": []}
        for _ in range(args.warmup):
            ours_step(), theirs_step()
        for _ in range(args.rounds):
            for name, step in (("megafab", ours_step), ("megatron-core", theirs_step)):
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    print(f"MLA forward + backward, fp32, one process ({torch.get_num_threads()} threads); outputs differ by "
          f"{diff:.1e}; ms median [min-max] of {args.rounds}")
    base = median_spread(times["megafab"])[0]
    for name, values in times.items():
        med, lo, hi = (v * 1e3 for v in median_spread(values))
        print(f"{name:<16}{med:>10.1f} [{lo:.1f}-{hi:.1f}]")
    print(f"ratio megatron-core / megafab: {median_spread(times['megatron-core'])[0] / base:.2f}x "
          f"(of the minima, the least disturbed rounds: "
          f"{min(times['megatron-core']) / min(times['megafab']):.2f}x)")


def memory(args) -> None:
    print("MLA activation bytes, one forward (KiB): measured, planned (plan/mla_activations.py)")
    print(f"{'recompute':<24}{'measured':>10}{'planned':>10}{'ratio':>7}{'drop':>10}{'planned':>10}"
          f"{'fwd+bwd ms':>12}")
    base = None
    for modules in RECOMPUTE:
        cfg = config(args, modules)
        layer = megafab_layer(cfg)
        x, rotary, positions = inputs(args, cfg)
        x.requires_grad_(True)
        cos, sin = rotary(positions, x.dtype)
        with SavedActivations([*layer.parameters(), x, cos, sin]) as saved:
            out = layer(x, (cos, sin))
        out.sum().backward()
        times = []
        for _ in range(args.warmup + args.rounds):
            start = time.perf_counter()
            layer(x, rotary(positions, x.dtype)).sum().backward()
            times.append(time.perf_counter() - start)
        times = times[args.warmup:]
        planned = mla_attention_bytes(cfg, "cpu", "core_attn" in modules, "mla_up_proj" in modules)
        base = base or (saved.bytes, planned)
        drop, planned_drop = base[0] - saved.bytes, base[1] - planned
        print(f"{modules:<24}{saved.bytes / 1024:>10.1f}{planned / 1024:>10.1f}{planned / saved.bytes:>7.3f}"
              f"{drop / 1024:>10.1f}{planned_drop / 1024:>10.1f}{median_spread(times)[0] * 1e3:>12.1f}",
              flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    h = args.hidden
    print(f"MLA: hidden {h}, {args.heads} heads, q LoRA {3 * h // 8}, kv LoRA {h // 8}, qk = v "
          f"{h // args.heads}, pe {h // args.heads // 2}, YaRN x40, seq {args.seq}, micro-batch "
          f"{args.batch}; {load_average()}")
    memory(args)
    speed(args)
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
