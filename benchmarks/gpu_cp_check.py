"""Context-parallel attention's fused kernels on one device (CUDA: the unverified flash path).

    python benchmarks/gpu_cp_check.py [--out results/cp_check.json]        # H200: well under a minute
    python benchmarks/gpu_cp_check.py --device cpu --dtype fp32 --seq 2048 --heads 8 --groups 8 --dim 32 \
        --batch 2                 # CPU, one thread, CPU seconds: the CP benchmark's attention shape

One GPU cannot run a CP group (NCCL takes one rank per device), so the ring's math is emulated in
one process: every CP rank's blocks (context_parallel.ring_plan, the kernel megafab picks,
LseMerge), forward, and backward from the merged output and log-sum-exp, with every rank's dK/dV
summed as the ring would. Checked and printed:

  1. parity: the emulated CP 2 and CP 4 attention with the fused kernel and with the portable
     reference, against one process's attention (fp32 math), output and gradients;
  2. no host-device sync: context_parallel_attention's real autograd path (p2p and allgather on a
     1-rank group: one causal block, or full + causal blocks with merges) forward and backward
     under torch.cuda.set_sync_debug_mode("error");
  3. time: one CP 2 rank's attention blocks (both ranks' emulated, / 2), forward + backward, fused
     vs reference, next to
     whole-sequence SDPA (CP 1) and, where Transformer Engine is installed, TE's DotProductAttention
     on the whole sequence; the ideal CP 2 rank takes half of CP 1's time.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megafab.distributed.blockwise_attention import LseMerge, compute_dtype  # noqa: E402
from megafab.distributed.context_parallel import (  # noqa: E402
    context_parallel_attention,
    ring_plan,
    split_for_context_parallel,
)
from megafab.distributed.fused_attention import block_kernel  # noqa: E402
from megafab.model.te import te_available  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=16384, help="whole sequence (CP 1)")
    p.add_argument("--parity-seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    return p.parse_args(argv)


def emulated_ring(q, k, v, dout, cp: int, implementation: str):
    """(out, dq, dk, dv) over the whole sequence from every CP rank's ring blocks, in one process."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    kernel = block_kernel(q, implementation=implementation)
    local = [[split_for_context_parallel(t, 2, r, cp) for r in range(cp)] for t in (q, k, v, dout)]
    acc = compute_dtype(q.dtype)
    outs, dqs = [], []
    dks = [torch.zeros_like(t, dtype=acc) for t in local[1]]
    dvs = [torch.zeros_like(t, dtype=acc) for t in local[2]]
    for r in range(cp):
        ql, dl = local[0][r], local[3][r]
        plan = ring_plan(ql.shape[2] // 2, cp, r)
        merge, aux = LseMerge(ql), []
        for step, blocks in enumerate(plan):
            src = (r - step) % cp
            for blk in blocks:
                o, lse, extra = kernel.forward(ql[:, :, blk.rows], local[1][src][:, :, blk.keys],
                                               local[2][src][:, :, blk.keys], blk.causal, scale)
                merge.add(blk.rows, o, lse, blk.first)
                aux.append(extra)
        out = merge.out.to(q.dtype)
        dq = torch.zeros_like(ql, dtype=acc)
        blocks = [(step, blk) for step, bs in enumerate(plan) for blk in bs]
        for (step, blk), extra in zip(blocks, aux):
            src = (r - step) % cp
            g = kernel.backward(dl[:, :, blk.rows], ql[:, :, blk.rows], local[1][src][:, :, blk.keys],
                                local[2][src][:, :, blk.keys], out[:, :, blk.rows], merge.lse[..., blk.rows],
                                blk.causal, scale, 0, extra)
            dq[:, :, blk.rows] += g[0]
            dks[src][:, :, blk.keys] += g[1]
            dvs[src][:, :, blk.keys] += g[2]
        outs.append(out)
        dqs.append(dq)
    return outs, dqs, dks, dvs


def inputs(args, seq, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    shape_q, shape_kv = (args.batch, args.heads, seq, args.dim), (args.batch, args.groups, seq, args.dim)
    return [torch.randn(s, generator=g, device=device, dtype=dtype)
            for s in (shape_q, shape_kv, shape_kv, shape_q)]


def parity(args, device, dtype) -> dict:
    q, k, v, dout = inputs(args, args.parity_seq, device, dtype)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=args.heads != args.groups)
    ref.backward(dout.float())
    worst = {}
    for cp in (2, 4):
        for implementation in ("auto", "reference"):
            outs, dqs, dks, dvs = emulated_ring(q, k, v, dout, cp, implementation)
            err = 0.0
            for mine, full in ((outs, ref.detach()), (dqs, qf.grad), (dks, kf.grad), (dvs, vf.grad)):
                for r in range(cp):
                    theirs = split_for_context_parallel(full, 2, r, cp)
                    err = max(err, ((mine[r].float() - theirs).abs().max() / theirs.abs().max()).item())
            worst[f"cp{cp}_{implementation}"] = err
            print(f"parity CP {cp} {implementation:<9} max relative error {err:.2e}", flush=True)
    return worst


def no_sync(args, device, dtype) -> dict:
    """context_parallel_attention's autograd path on a 1-rank group, syncs made errors on CUDA."""
    q, k, v, dout = inputs(args, args.parity_seq, device, dtype, seed=1)
    q.requires_grad_()
    result = {}
    for comm in ("p2p", "allgather"):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = context_parallel_attention(q, k, v, dist.group.WORLD, comm)
            out.backward(dout)
            result[comm] = "no sync"
        except RuntimeError as err:
            result[comm] = f"FAILED: {err}"
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        print(f"sync check {comm}: {result[comm]}", flush=True)
    return result


def timed(fn, device, repeats: int) -> float:
    """Seconds per call: wall time on CUDA; on CPU this process's CPU seconds (one thread, so
    other people's load on a shared machine does not count)."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = clock()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (clock() - t0) / repeats


def timing(args, device, dtype) -> dict:
    q, k, v, dout = inputs(args, args.seq, device, dtype, seed=2)
    gqa = args.heads != args.groups

    def sdpa():
        qr = q.detach().requires_grad_()
        F.scaled_dot_product_attention(qr, k, v, is_causal=True, enable_gqa=gqa).backward(dout)

    result = {"cp1_sdpa_s": timed(sdpa, device, args.repeats)}
    for implementation in ("auto", "reference"):  # both ranks' blocks run here: / 2 per rank
        ring = functools.partial(emulated_ring, q, k, v, dout, 2, implementation)
        result[f"cp2_rank_{implementation}_s"] = timed(ring, device, args.repeats) / 2
    if te_available() and device.type == "cuda":
        import transformer_engine.pytorch as te

        attention = te.DotProductAttention(args.heads, args.dim, num_gqa_groups=args.groups,
                                           attn_mask_type="causal", qkv_format="sbhd")
        k_s, v_s, dout_s = (t.permute(2, 0, 1, 3).contiguous() for t in (k, v, dout))

        def te_attention():
            qr = q.permute(2, 0, 1, 3).contiguous().requires_grad_()
            attention(qr, k_s, v_s).backward(dout_s.flatten(2))

        result["cp1_te_s"] = timed(te_attention, device, args.repeats)
    for name, value in result.items():
        print(f"time {name}: {value * 1e3:.2f} ms", flush=True)
    if "cp1_te_s" not in result:
        result["cp1_te_s"] = "skipped: transformer_engine not installed (or not CUDA)"
        print(f"time cp1_te_s: {result['cp1_te_s']}", flush=True)
    ideal = result["cp1_sdpa_s"] / 2
    for implementation in ("auto", "reference"):
        print(f"CP 2 rank {implementation}: {ideal / result[f'cp2_rank_{implementation}_s']:.2f} of ideal "
              f"(CP 1 SDPA / 2)", flush=True)
    return result


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_cp_check: --device cuda but CUDA is not available; use --device cpu", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store_file = tempfile.NamedTemporaryFile(prefix="megafab_cp_check_", delete=False).name
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=0, world_size=1)
    kernel = type(block_kernel(torch.empty(1, 1, 1, args.dim, device=device, dtype=dtype))).__name__
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "dtype": args.dtype, "kernel": kernel, "shape": vars(args)}
    print(f"gpu_cp_check on {results['device']}, {args.dtype}: fused kernel {kernel}", flush=True)
    try:
        results["parity_max_relative_error"] = parity(args, device, dtype)
        results["sync"] = no_sync(args, device, dtype)
        results["time"] = timing(args, device, dtype)
    finally:
        dist.destroy_process_group()
        if os.path.exists(store_file):  # the file store may have removed it
            os.unlink(store_file)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    tolerance = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    ok = all(e < tolerance for e in results["parity_max_relative_error"].values())
    ok = ok and all(v == "no sync" for v in results["sync"].values())
    print("gpu_cp_check:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
