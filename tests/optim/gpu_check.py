"""GPU/NCCL smoke check of DP + the distributed optimizer (run on a CUDA machine; not collected).

    python -m tests.optim.gpu_check

One NCCL rank (NCCL refuses two ranks on one GPU): bf16 model on cuda, DDP with overlap and
ReduceOp.AVG, the distributed optimizer with fused AdamW and overlapped param gather; the loss must
fall and every buffer and optimizer tensor must live on the GPU.
"""

import datetime

import torch
import torch.distributed as dist

from megafab.distributed.data_parallel import DistributedDataParallel
from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.topology import build_topology
from megafab.optim import DistributedOptimizer, measure_memory
from tests.helpers.toy import ToyMLP, mse, regression_batch


def main():
    store = dist.TCPStore("127.0.0.1", 29533, 1, True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    torch.cuda.set_device(0)
    topo = build_topology()
    assert topo.device.type == "cuda", topo.device
    model = DistributedDataParallel(ToyMLP(64, layers=3, dtype=torch.bfloat16).to(topo.device),
                                    dp_group=topo.group("dp"), bucket_size=2000, overlap_grad_reduce=True,
                                    use_distributed_optimizer=True, average_in_collective=True)
    opt = DistributedOptimizer([model], topology=topo, lr=1e-2, overlap_param_gather=True)
    x, y = (t.to(topo.device) for t in regression_batch(32, 64, dtype=torch.bfloat16))
    losses = []
    for _ in range(50):
        opt.zero_grad()
        loss = mse(model, x, y)
        loss.backward()
        finalize_model_grads([model], topology=topo)
        ok, norm, _ = opt.step()
        assert ok
        losses.append(loss.item())
    model.finish_param_sync()
    assert model.grad_buffer.is_cuda and model.param_buffer.is_cuda
    assert all(e.main.is_cuda for e in opt.entries)
    assert all(v.is_cuda for s in opt.optimizer.state.values() for k, v in s.items() if k != "step")
    report = measure_memory([model], opt)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; fused={opt.optimizer.defaults.get('fused')}; "
          f"bytes/param {report.per_param()}")
    assert losses[-1] < 0.5 * losses[0]
    dist.destroy_process_group()
    print("GPU CHECK OK")


if __name__ == "__main__":
    main()
