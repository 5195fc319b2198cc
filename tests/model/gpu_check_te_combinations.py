"""GPU check of Transformer Engine as a peer path (issue 39 item 5; run on a CUDA machine with TE, not
collected): the real TE layers under selective recompute (each module), FSDP2 and context parallelism.

    python -m torch.distributed.run --nproc-per-node N -m tests.model.gpu_check_te_combinations
    python -m torch.distributed.run --nproc-per-node 2 -m tests.model.gpu_check_te_combinations \
        --device cpu --fake-te     # the same logic through tests/helpers/fake_te.py on gloo (seconds)

Each check compares TE's layers with TE's layers, fp32 weights: selective recompute of each module
(fp32 and, on compute capability >= 8.9, FP8 for the dense modules, whose GEMM sizes FP8
takes) equals no recompute; FSDP2 (ZeRO-3 over all N ranks, N = 1 included) gives DDP's losses and,
with FP8, finite falling losses; CP over all N ranks (N >= 2; p2p, allgather, a2a) gives one rank's
loss and gradients. Prints one line per check and "gpu_check_te_combinations: PASS".
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from megafab.distributed.context_parallel import context_parallel_masked_mean, split_for_context_parallel
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.moe.balancing import LossScale
from megafab.model.moe.settings import MoESettings
from megafab.model.transformer import LayerContext
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from megafab.training.step import train_step
from tests.helpers.mcore_mla import MLA_STYLE
from tests.helpers.mcore_mtp import MOE
from tests.helpers.tiny import LLAMA_STYLE, batch, tiny_config

TE = dict(transformer_impl="transformer_engine", bf16=True)
DENSE = ("core_attn", "layernorm", "mlp")
DEEPSEEK = ("mla_up_proj", "moe", "shared_experts", "moe_act")


def _say(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return (a.float() - b.float()).abs().max().item() <= rel * max(1.0, b.float().abs().max().item())


def _model(device, module=None, fp8=False, recompute=True, cp_group=None, comm="p2p"):
    """A TE model in fp32 weights: dense Llama-style, or for the MLA/MoE modules the DeepSeek-style
    model with MTP; `module` selectively recomputed where `recompute`."""
    dense = module is None or module in DENSE
    style, sizes = (LLAMA_STYLE, {}) if dense else (MLA_STYLE, dict(num_layers=2, mtp_num_layers=1))
    moe = None if dense else MoESettings(**MOE, moe_grouped_gemm=module == "moe_act")
    if module == "moe_act":  # the config rule reads the MoE flags
        sizes.update(MOE, moe_grouped_gemm=True)
    extra = dict(recompute_granularity="selective", recompute_modules=[module]) \
        if module and recompute else {}
    cfg = tiny_config(style=style, **sizes, **TE, **extra, **({"fp8_format": "hybrid"} if fp8 else {}))
    tracker = RNGStatesTracker(device)
    model_parallel_seed(1234, 0, 0, device, tracker)
    ctx = LayerContext(None, False, torch.float32, device, 1234, tracker, precision=cfg.precision,
                       cp_group=cp_group, cp_comm_type=comm, moe=moe,
                       moe_loss_scale=LossScale() if moe else None)
    model = GPTModel(cfg.model, ctx)
    if model.mtp_depths:
        model.mtp.loss_scale.set(1.0)
        ctx.moe_loss_scale.set(1.0)
    return model


def _loss_and_grads(model, tokens, labels, mask):
    loss = masked_mean_loss(model(tokens, labels=labels, loss_mask=mask), mask)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def check_recompute(device, fp8: bool) -> None:
    for module in DENSE + (() if fp8 else DEEPSEEK):  # FP8 GEMMs need sizes % 16: MLA's ranks are not
        plain_model = _model(device, module, fp8, recompute=False)
        tokens, labels, mask = (t.to(device) for t in batch(plain_model.cfg, seed=3))
        plain = _loss_and_grads(plain_model, tokens, labels, mask)
        recomputed = _loss_and_grads(_model(device, module, fp8), tokens, labels, mask)
        assert _close(recomputed[0], plain[0], 1e-5), (module, recomputed[0], plain[0])
        assert recomputed[1].keys() == plain[1].keys(), module
        for name, grad in plain[1].items():
            assert _close(recomputed[1][name], grad, 1e-4), (module, name)
        _say(f"recompute {module:<15} {'fp8' if fp8 else 'fp32'}: loss {plain[0].item():.6f} equal, "
              f"{len(plain[1])} gradients equal")


def check_fsdp(device, world: int, fp8: bool) -> None:
    topo = build_topology()
    losses = {}
    for name, layout in (("DDP", {}), ("FSDP2", dict(use_torch_fsdp2=True))):
        cfg = tiny_config(style=LLAMA_STYLE, dp=world, micro_batch_size=2, global_batch_size=2 * world,
                          lr=1e-2, train_iters=4, **TE, **layout, **({"fp8_format": "hybrid"} if fp8 else {}))
        tracker = RNGStatesTracker(device)
        model_parallel_seed(1234, 0, 0, device, tracker)
        model = build_model(cfg, topo, tracker, dtype=torch.float32)
        optimizer = build_optimizer(cfg, topo, model)
        state = TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))
        steps = []
        for _ in range(3):
            tokens, labels, mask = (t.to(device) for t in batch(cfg.model, seed=topo.dp_rank))
            data = [{"tokens": tokens, "labels": labels, "loss_mask": mask}]
            steps.append(train_step(state, iter(data))["lm loss"])
        losses[name] = steps
    for x, y in zip(losses["FSDP2"], losses["DDP"]):
        assert abs(x - y) <= (5e-2 if fp8 else 1e-4) * abs(y), losses
    assert all(torch.isfinite(torch.tensor(losses["FSDP2"]))), losses
    assert losses["FSDP2"][-1] < losses["FSDP2"][0], losses
    _say(f"fsdp2 dp {world} {'fp8' if fp8 else 'fp32'}: losses {losses['FSDP2']} vs DDP {losses['DDP']}")


def check_cp(device, world: int) -> None:
    topo = build_topology(cp=world)
    group, rank = topo.group("cp"), topo.cp_rank
    tokens, labels, mask = (t.to(device) for t in batch(_model(device).cfg, seed=5))
    ref = _loss_and_grads(_model(device), tokens, labels, mask)

    def local(t):
        return split_for_context_parallel(t, 1, rank, world)
    for comm in ("p2p", "allgather", "a2a"):
        model = _model(device, cp_group=group, comm=comm)
        loss = context_parallel_masked_mean(model(local(tokens), labels=local(labels)), local(mask), group)
        loss.backward()
        assert _close(loss.detach(), ref[0], 1e-4), (comm, loss.item(), ref[0].item())
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad, group=group)
            assert _close(p.grad / world, ref[1][name], 1e-3), (comm, name)
        _say(f"cp {world} {comm}: loss {loss.item():.6f} equal to one rank's, gradients equal")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--fake-te", action="store_true", help="tests/helpers/fake_te.py instead of TE (CPU)")
    args = ap.parse_args(argv)
    if args.fake_te:
        from tests.helpers import fake_te

        sys.modules.update(fake_te.build([]))
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    fp8 = args.fake_te or (cuda and torch.cuda.get_device_capability() >= (8, 9))
    check_recompute(device, fp8=False)
    if fp8:
        check_recompute(device, fp8=True)
    check_fsdp(device, world, fp8=False)
    if fp8:
        check_fsdp(device, world, fp8=True)
    if world >= 2:
        check_cp(device, world)
    else:
        _say("cp: skipped: needs 2+ ranks (one per GPU)")
    dist.destroy_process_group()
    _say("gpu_check_te_combinations: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
