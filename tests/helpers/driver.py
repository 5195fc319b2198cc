"""The training driver on a rank as pretrain builds it, and a single-process reference to compare
its steps with (parity tests of tests/training and tests/distributed)."""

import torch

from megafab.data.packed_documents import attach_document_mask
from megafab.distributed.fsdp import is_dtensor
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.layout import rank_order
from megafab.model.gpt import masked_mean_loss
from megafab.optim.memory import measure_memory
from megafab.optim.mixed_precision import MixedPrecisionOptimizer
from megafab.plan.planner import plan
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from megafab.training.step import train_step
from tests.helpers.tiny import batch, full_grad, reference_model

STEPS = 3
MICRO = 2  # micro-batch size


def make_samples(cfg, count):
    out = []
    for i in range(count):
        tokens, labels, mask = batch(cfg, micro_batch=1, seed=100 + i)
        out.append((tokens[0], labels[0], mask[0]))
    return out


def micro_batches(samples, start, dp_rank, dp, count):
    """Megatron's sampler: micro-batch k of DP rank d is samples [k*b*dp + d*b, ... + b)."""
    for k in range(count):
        lo = start + k * MICRO * dp + dp_rank * MICRO
        chunk = samples[lo:lo + MICRO]
        out = {"tokens": torch.stack([c[0] for c in chunk]), "labels": torch.stack([c[1] for c in chunk]),
               "loss_mask": torch.stack([c[2] for c in chunk])}
        for key in chunk[0][3] if len(chunk[0]) > 3 else ():  # a sample's other fields (a dict)
            out[key] = torch.stack([c[3][key] for c in chunk])
        yield out


def reference_run(cfg, samples, gbs):
    model = reference_model(cfg.model)
    o = cfg.optimizer
    opt = MixedPrecisionOptimizer([model], lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad)
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        micro = list(micro_batches(samples, step * gbs, 0, 1, gbs // MICRO))
        for mb in micro:
            mb = attach_document_mask(mb)  # --dataloader-inter-document-masking's, as the driver's step
            loss = masked_mean_loss(model(mb["tokens"], mb.get("position_ids"), labels=mb["labels"],
                                          attention_mask=mb.get("attention_mask")), mb["loss_mask"])
            (loss / len(micro)).backward()
        _, norm, _ = opt.step()
        history.append((norm, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return history


def driver_state(cfg, dtype: torch.dtype | None = None) -> TrainState:
    """The driver's TrainState for `cfg` on this rank, as pretrain builds it (dtype: the model's,
    e.g. float64 for parity tests; None: the config's precision)."""
    p = cfg.parallel
    topo = build_topology(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                          vpp=p.virtual_pipeline_model_parallel_size or 1, cp=p.context_parallel_size,
                          ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
                          order=rank_order(p.use_tp_pp_dp_mapping))
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(cfg.training.seed, topo.tp_rank, topo.pp_rank, topo.device, tracker,
                        cp_rank=topo.cp_rank)
    model = build_model(cfg, topo, tracker, dtype=dtype)
    optimizer = build_optimizer(cfg, topo, model)
    return TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))


def train_and_compare(state, samples, reference, gbs, min_norm: float = 0.0) -> float:
    """STEPS driver steps; after each, the grad norm and every parameter equal the reference's
    (1e-10), and the reference norm exceeds `min_norm` (clipping binds). Returns the last loss."""
    cfg, topo = state.cfg, state.topology
    tp_group = topo.group("tp") if topo.tp > 1 else None
    for step in range(STEPS):
        data = micro_batches(samples, step * gbs, topo.dp_rank, topo.dp, cfg.training.num_micro_batches)
        metrics = train_step(state, data)
        ref_norm, ref_params = reference[step]
        assert abs(metrics["grad_norm"] - ref_norm) < 1e-10 * max(1.0, ref_norm), (metrics, ref_norm)
        assert ref_norm > min_norm, (step, ref_norm)
        for chunk in state.model:
            for name, p in chunk.module.named_parameters():
                ref_name = "embedding.word_embeddings.weight" if name == "output_layer.weight" and \
                    not cfg.model.untie_embeddings_and_output_weights else name
                err = (full_values(p, tp_group) - ref_params[ref_name]).abs().max().item()
                assert err < 1e-10, (step, name, err)
    return metrics["lm loss"]


def cfg_layers_per_chunk(pp, vpp):
    return 4 // (pp * vpp)


def full_values(p, tp_group) -> torch.Tensor:
    """The single-process tensor of parameter `p`: FSDP2 shards gathered over DP, TP joined
    (full_grad gathers .grad, so it is pointed at the values)."""
    values = p.full_tensor() if is_dtensor(p) else p
    holder = torch.nn.Parameter(values.detach().clone(), requires_grad=False)
    holder.grad = values.detach()
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(p, attr):
            setattr(holder, attr, getattr(p, attr))
    return full_grad(holder, tp_group)


def measured_after_one_step(cfg):
    """measure_memory of the driver's state for `cfg` after one optimizer step on this rank's
    micro-batch, and the planner's first stage."""
    state = driver_state(cfg)
    model, optimizer = state.model, state.optimizer
    optimizer.zero_grad()
    tokens, labels, mask = batch(cfg.model, seed=state.topology.dp_rank)
    masked_mean_loss(model[0](tokens, labels=labels), mask).float().backward()
    model[0].finish_grad_sync()
    optimizer.step()
    return measure_memory(model, optimizer), plan(cfg)[0]
