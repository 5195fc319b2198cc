"""GPU/NCCL check of FSDP2 and optimizer CPU offload (run on a CUDA machine; not collected).

    python -m tests.optim.gpu_check_sharding              # one NCCL rank on cuda:0
    python -m tests.optim.gpu_check_sharding --device cpu # the same checks on gloo (seconds)

A bf16 GPT (4 x 256) trains 4 steps as DDP, FSDP2, FSDP2 with offload (fraction 0.5) and the
distributed optimizer with offload, one rank. On CUDA: every host buffer of the offload is pinned
and on the CPU, the model weights and gradients stay on the GPU, the copies run on their own
streams (megafab.optim.cpu_offload); offloading leaves less optimizer state on the device; every
layout logs DDP's losses (up to the reduction order) and the loss falls.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist

from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.optim.memory import measure_memory
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from megafab.training.step import train_step
from tests.helpers.tiny import batch, tiny_config

LAYOUTS = {"DDP": {}, "FSDP2": dict(use_torch_fsdp2=True),
           "FSDP2 + offload 0.5": dict(use_torch_fsdp2=True, optimizer_cpu_offload=True,
                                       optimizer_offload_fraction=0.5),
           "dist-opt + offload": dict(use_distributed_optimizer=True, optimizer_cpu_offload=True)}


def run(topo, layout: dict) -> tuple[list[float], int, object]:
    cfg = tiny_config(bf16=True, hidden_size=256, num_attention_heads=8, seq_length=64, vocab_size=1024,
                      micro_batch_size=2, global_batch_size=4, lr=3e-3, train_iters=10, **layout)
    tracker = RNGStatesTracker(topo.device)
    model_parallel_seed(1234, 0, 0, topo.device, tracker)
    model = build_model(cfg, topo, tracker)
    optimizer = build_optimizer(cfg, topo, model)
    state = TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))
    losses = []
    for _ in range(4):
        data = []
        for k in range(2):
            tokens, labels, mask = batch(cfg.model, micro_batch=2, seed=k)  # the same every step
            data.append({"tokens": tokens, "labels": labels, "loss_mask": mask})
        losses.append(train_step(state, iter(data))["lm loss"])
    host = optimizer.host
    if host is not None and topo.device.type == "cuda":
        assert all(t.device.type == "cpu" and t.is_pinned() for t in host.host_tensors())
        assert all(e.model_values().device.type == "cuda" for e in host.entries)
        assert host._d2h is not None and host._h2d is not None
    return losses, measure_memory(model, optimizer).optimizer_bytes, host


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    store = dist.TCPStore("127.0.0.1", 29534, 1, True)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    if cuda:
        torch.cuda.set_device(0)
    topo = build_topology()
    results = {name: run(topo, layout) for name, layout in LAYOUTS.items()}
    reference = results["DDP"][0]
    for name, (losses, optimizer_bytes, _) in results.items():
        print(f"{name:<22} losses {' '.join(f'{x:.4f}' for x in losses)}  device optimizer "
              f"{optimizer_bytes / 2**20:.2f} MiB")
        assert losses[-1] < losses[0], (name, losses)
        for x, y in zip(losses, reference):
            assert abs(x - y) <= 5e-3 * abs(y), (name, losses, reference)
    assert results["FSDP2 + offload 0.5"][1] < results["FSDP2"][1]
    assert results["dist-opt + offload"][1] == 0
    dist.destroy_process_group()
    print("gpu_check_sharding: ok")


if __name__ == "__main__":
    main()
