"""Full 3D training through the driver's train_step equals one process, parameters after every step.

TP2 x PP2 x DP2 with sequence parallel and the distributed optimizer (and DP-only variants), float64,
3 AdamW steps with clipping, against a single-process model and MixedPrecisionOptimizer.
"""

import pytest
import torch

from megafab.distributed.fsdp import is_dtensor
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.model.gpt import masked_mean_loss
from megafab.optim.mixed_precision import MixedPrecisionOptimizer
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from megafab.training.step import train_step
from tests.harness import run_ranks
from tests.model.tiny import GPT2_STYLE, LLAMA_STYLE, batch, full_grad, reference_model, tiny_config

STEPS = 3
MICRO = 2  # micro-batch size


def _samples(cfg, count):
    out = []
    for i in range(count):
        tokens, labels, mask = batch(cfg, micro_batch=1, seed=100 + i)
        out.append((tokens[0], labels[0], mask[0]))
    return out


def _micro_batches(samples, start, dp_rank, dp, count):
    """Megatron's sampler: micro-batch k of DP rank d is samples [k*b*dp + d*b, ... + b)."""
    for k in range(count):
        lo = start + k * MICRO * dp + dp_rank * MICRO
        chunk = samples[lo:lo + MICRO]
        yield {"tokens": torch.stack([c[0] for c in chunk]), "labels": torch.stack([c[1] for c in chunk]),
               "loss_mask": torch.stack([c[2] for c in chunk])}


def _reference_run(cfg, samples, gbs):
    model = reference_model(cfg.model)
    o = cfg.optimizer
    opt = MixedPrecisionOptimizer([model], lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad)
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        micro = list(_micro_batches(samples, step * gbs, 0, 1, gbs // MICRO))
        for mb in micro:
            loss = masked_mean_loss(model(mb["tokens"], labels=mb["labels"]), mb["loss_mask"])
            (loss / len(micro)).backward()
        _, norm, _ = opt.step()
        history.append((norm, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return history


def _driver_parity(rank, world, tp, pp, vpp, sp, dist_opt, overlap, style):
    dp = world // (tp * pp)
    gbs = MICRO * dp * 2
    flat = dict(tp=tp, pp=pp, style=style, dp=dp, vocab_size=112, micro_batch_size=MICRO,
                global_batch_size=gbs, sequence_parallel=sp, use_distributed_optimizer=dist_opt,
                overlap_grad_reduce=overlap, ddp_bucket_size=2000, lr=1e-2, clip_grad=0.5,
                lr_decay_style="constant", train_iters=STEPS)
    if vpp > 1:
        flat["num_layers_per_virtual_pipeline_stage"] = cfg_layers_per_chunk(pp, vpp)
    cfg = tiny_config(**flat)
    ref_cfg = tiny_config(style=style, vocab_size=112, lr=1e-2, clip_grad=0.5)
    samples = _samples(cfg.model, gbs * STEPS)
    reference = _reference_run(ref_cfg, samples, gbs)

    return train_and_compare(driver_state(cfg, torch.float64), samples, reference, gbs)


def driver_state(cfg, dtype: torch.dtype | None = None) -> TrainState:
    """The driver's TrainState for `cfg` on this rank, as pretrain builds it (dtype: the model's,
    e.g. float64 for parity tests; None: the config's precision)."""
    p = cfg.parallel
    topo = build_topology(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                          vpp=p.virtual_pipeline_model_parallel_size or 1, cp=p.context_parallel_size)
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
        data = _micro_batches(samples, step * gbs, topo.dp_rank, topo.dp, cfg.training.num_micro_batches)
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


@pytest.mark.parametrize("world,tp,pp,vpp,sp,dist_opt,overlap,style", [
    (2, 1, 1, 1, False, False, False, GPT2_STYLE),
    (2, 1, 1, 1, False, True, True, LLAMA_STYLE),
    (4, 1, 1, 1, False, True, False, GPT2_STYLE),
    (4, 1, 1, 1, False, False, True, GPT2_STYLE),
    (8, 2, 2, 1, True, True, False, GPT2_STYLE),
    (8, 2, 2, 2, True, True, True, LLAMA_STYLE),
], ids=["dp2", "dp2-distopt-overlap-llama", "dp4-distopt", "dp4-overlap", "tp2pp2dp2-sp-distopt",
        "tp2pp2vpp2dp2-sp-distopt-overlap-llama"])
def test_training_steps_equal_single_process(world, tp, pp, vpp, sp, dist_opt, overlap, style):
    run_ranks(_driver_parity, world, tp, pp, vpp, sp, dist_opt, overlap, style, timeout=300)
