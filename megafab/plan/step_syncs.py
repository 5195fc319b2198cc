"""The small collectives a training step runs once after its backward, besides the data-parallel
gradient reduction (step_time.data_parallel_seconds prices that one): each is a few bytes to a few
KiB, so its cost is the group's latency, which on a CPU's gloo is ~0.5 ms a call and, in a step of
few micro-batches, 10-20% of it.

    TP > 1 with SP, or with q/k layernorms: the TP-replicated parameters' gradients summed over TP
        (megafab.distributed.finalize_grads.allreduce_tp_partial_grads);
    PP > 1 with tied embeddings: the two embedding copies' gradients summed between the first and
        the last stage (allreduce_embedding_grads);
    the gradient norm: one all-reduce per group of megafab.optim.mixed_precision's _norm_groups (TP x
        PP; DP x CP first when each rank steps its own shard), one more for fp16's non-finite check;
    the loss averaged over DP (megafab.training.step.average_loss_across_dp).
"""

from __future__ import annotations

from megafab.plan.collectives import Placement, collective_seconds, group_placement

SCALAR = 8  # bytes of one fp64 statistic (norm, loss, non-finite flag)


def _sequence_parallel_params(cfg) -> int:
    """Per rank: the norms' weights and biases of every layer (2 norms, q/k norms too) and the final
    norm, the parameters SP leaves replicated over TP."""
    m = cfg.model
    per_layer = 2 * 2 * m.hidden_size + (2 * m.kv_channels * 2 if m.qk_layernorm else 0)
    return per_layer * m.num_layers // cfg.parallel.pipeline_model_parallel_size + 2 * m.hidden_size


def step_sync_seconds(cfg, machine) -> float:
    p, m = cfg.parallel, cfg.model
    tp = group_placement(cfg, machine, "tp")
    seconds = 0.0
    if p.sequence_parallel or m.qk_layernorm:
        seconds += collective_seconds(machine, "all_reduce", 4 * _sequence_parallel_params(cfg), tp)
    pp = group_placement(cfg, machine, "pp")
    if pp.size > 1 and not m.untie_embeddings_and_output_weights:
        ends = Placement(2, 1 if pp.nodes > 1 else 2, min(2, pp.nodes), pp.world)
        embedding = 4 * m.padded_vocab_size // p.tensor_model_parallel_size * m.hidden_size
        seconds += collective_seconds(machine, "all_reduce", embedding, ends)
    groups = [group_placement(cfg, machine, "tp", "pp")]
    if p.use_distributed_optimizer or p.fully_sharded:
        groups.insert(0, group_placement(cfg, machine, "dp", "cp"))
    checks = 2 if cfg.precision.params_dtype_name == "float16" else 1
    seconds += checks * sum(collective_seconds(machine, "all_reduce", SCALAR, g) for g in groups)
    return seconds + collective_seconds(machine, "all_reduce", SCALAR, group_placement(cfg, machine, "dp"))
