"""Pre-launch plan: per pipeline stage parameters, bytes of weights/grads/optimizer state, activation
memory, and FLOPs per iteration, from the config alone (no process group, no real tensors).

Parameters are counted on the layers the engine builds on the meta device (megafab.plan.params,
megafab.plan.inventory); training state per rank is megafab.plan.state_memory's (Megatron's
distributed-optimizer table, FSDP2's ZeRO-3 shards, CPU offload); activations are
megafab.plan.activations' formulas. An MoE layer (megafab.plan.moe) has its MoE MLP's activations in
place of the dense MLP's, with the routed rows at their bound (or balanced: routing="balanced"), and
one layer's token-dispatch buffers on top; its routed experts' state is sharded over expert-DP.

A stage's peak is its state plus the largest of: the activations of its in-flight micro-batches
(in_flight_chunks) with the loss's backward or a recomputed group on top; the distributed optimizer's
all-gather inputs after the step; FSDP2's largest unsharded-gradient moment.
"""

from __future__ import annotations

from dataclasses import dataclass

from megafab.config.moe import moe_settings
from megafab.model.rotary import rotary_channels
from megafab.plan.activations import (
    attention_kernels,
    core_attention_bytes,
    in_flight_chunks,
    kv_exchange_bytes,
    layer_activation_bytes,
    mask_bytes,
    mlp_activation_bytes,
    norm_stats_bytes,
)
from megafab.plan.flops import flops_per_iteration
from megafab.plan.moe import (
    bound_rows,
    dispatcher_bytes,
    expected_rows,
    expert_data_parallel_size,
    expert_sizes,
    moe_mlp_activation_bytes,
    stage_state_bytes,
)
from megafab.plan.mtp_activations import mtp_activation_bytes
from megafab.plan.params import (
    LayerParams,
    chunk_params,
    fsdp_layer_units,
    fsdp_root_params,
    largest_fsdp_unit,
    layer_param_split,
    layer_params,
    model_params,
    stage_param_split,
    stage_params,
)
from megafab.plan.state_memory import BYTES, fsdp_moments

__all__ = ["BYTES", "ROUTING", "StagePlan", "attention_kernels", "chunk_params", "core_attention_bytes",
           "format_plan", "fsdp_layer_units", "fsdp_root_params", "in_flight_chunks", "iteration_flops",
           "kv_exchange_bytes", "largest_fsdp_unit", "layer_activation_bytes", "layer_param_split",
           "layer_params", "mlp_activation_bytes", "model_params", "parameters_line", "plan",
           "stage_param_split", "stage_params"]


@dataclass
class StagePlan:
    pp_rank: int
    params: int  # on each TP rank of this stage (all its chunks)
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes_per_micro_batch: int  # all layers of this stage, no pipelining
    layer_activation_bytes: int  # one layer, one micro-batch
    logits_bytes: int  # last stage only
    in_flight: float  # micro-batches of this stage's activations alive at the peak
    activation_peak_bytes: int
    forward_saved_bytes: int = 0  # what one micro-batch's forward leaves saved for its backward
    host_bytes: int = 0  # optimizer CPU offload: main params, Adam state and copy buffers on the host
    staging_bytes: int = 0  # --async-save's host staging (included in host_bytes)
    fsdp_held_bytes: int = 0  # FSDP2: the root's gathered weights and unsharded grads in backward
    fsdp_transient_bytes: int = 0  # FSDP2: the largest unsharded-gradient moment on top
    fsdp_moment: str = ""  # FSDP2: which moment fsdp_transient_bytes is
    gather_transient_bytes: int = 0  # distributed optimizer: all-gather inputs after the step
    kv_exchange_bytes: int = 0  # context parallel: transient K/V exchange buffers (in the peak)
    expert_params: int = 0  # MoE: the routed experts' part of params (reduced over expert-DP)
    dispatcher_bytes: int = 0  # MoE: one layer's transient token-dispatch buffers (in the peak)
    balanced_activation_peak_bytes: int = 0  # MoE: activation_peak_bytes under balanced routing
    routing: str = "bound"  # MoE: the routed rows in activation_peak_bytes (plan's routing)

    @property
    def state_bytes(self) -> int:
        """Weights, grads and optimizer state on the device, at rest."""
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes

    def _moments(self, activations: int) -> dict[str, int]:
        """What comes on top of the state (and FSDP2's held root) at each candidate peak."""
        moments = {"activations": activations, "gather": self.gather_transient_bytes}
        if self.fsdp_held_bytes or self.fsdp_transient_bytes:
            moments["fsdp"] = self.fsdp_transient_bytes
        return moments

    @property
    def total_bytes(self) -> int:
        """Device bytes at the peak (peak_phase says where). Building the model and loading a
        checkpoint stay below it: they hold one layer unsharded at a time, and no activations.
        FSDP2's largest unsharded-gradient moment and the activations are one max (see
        megafab.plan.state_memory)."""
        moments = self._moments(self.activation_peak_bytes)
        return self.state_bytes + self.fsdp_held_bytes + max(moments.values())

    @property
    def balanced_total_bytes(self) -> int:
        """total_bytes with an MoE stage's routed rows at balanced routing instead of their bound."""
        return self.state_bytes + self.fsdp_held_bytes + max(
            self._moments(self.balanced_activation_peak_bytes).values())

    @property
    def peak_phase(self) -> str:
        """Where total_bytes is reached."""
        moments = self._moments(self.activation_peak_bytes)
        top = max(moments, key=moments.get)
        if top == "gather":
            return "training step: state + the parameter all-gather after the optimizer step"
        if top == "fsdp":
            return f"training step: state + FSDP2's root (gathered, unsharded grad) + {self.fsdp_moment}"
        if self.fsdp_held_bytes:
            return "training step: state + FSDP2's root (gathered, unsharded grad) + activations (backward)"
        return "training step: state + activations (backward)"


ROUTING = ("bound", "balanced")


def plan(cfg, kernels: str = "flash", routing: str = "bound") -> list[StagePlan]:
    """One StagePlan per pipeline stage (every TP/DP rank of a stage holds the same amounts);
    kernels="cpu": PyTorch's CPU kernels and gloo's collectives (state_memory); routing: an MoE
    model's routed rows at their bound, or balanced (the expected count; dropless routing can
    exceed it), in the activations and the peak (balanced_activation_peak_bytes has the latter)."""
    m, p, t, pr = cfg.model, cfg.parallel, cfg.training, cfg.precision
    pp, vpp, tp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1, \
        p.tensor_model_parallel_size
    s, b, h = m.seq_length, t.micro_batch_size, m.hidden_size
    s //= p.context_parallel_size  # CP: each rank holds s/cp tokens
    kv_exchange = kv_exchange_bytes(cfg)
    r = tp if p.sequence_parallel else 1
    e = BYTES[pr.params_dtype_name]
    granularity = m.recompute_granularity
    layer = layer_activation_bytes(cfg, kernels)  # selective: what the --recompute-modules keep
    layer_input = e * s * b * h // r
    moe = moe_settings(cfg)
    # an MoE layer: its MoE MLP in place of the dense one, (layer bytes, dispatcher bytes) at the
    # routed rows' bound (the plan) and under balanced routing (shown beside it)
    routed = {}
    if moe is not None:
        for kind, rows in (("bound", bound_rows(cfg, moe)), ("balanced", expected_rows(cfg, moe))):
            routed[kind] = (layer - mlp_activation_bytes(cfg) + moe_mlp_activation_bytes(cfg, moe, rows, e),
                            dispatcher_bytes(cfg, moe, rows, e))

    def chunk_activations(sizes: list[int]) -> tuple[int, int]:
        """(kept per in-flight chunk, transient during its backward) for a chunk whose layers keep
        `sizes` bytes each."""
        if granularity != "full" or not sizes:
            return sum(sizes), 0
        n, per_chunk, largest = m.recompute_num_layers, len(sizes), max(sizes)
        if m.recompute_method == "uniform":
            return -(-per_chunk // n) * layer_input, min(n, per_chunk) * largest
        block = min(n, per_chunk)
        return block * layer_input + sum(sizes[block:]), largest if block else 0

    params_of = LayerParams(cfg)
    split, moe_layers = params_of.split, params_of.moe_layer
    counts = split.counts()
    out = []
    for rank in range(pp):
        # the stage's largest chunk bounds what each in-flight chunk keeps
        chunk_layers = [range(*split.layer_range(rank, c)) for c in range(len(counts[rank]))]
        has_moe = any(moe_layers[i] for layers in chunk_layers for i in layers)
        # (kept per in-flight chunk, backward transient, dispatch buffers) with MoE layers at each kind
        kept = {kind: max(chunk_activations([moe_layer if moe_layers[i] else layer for i in layers])
                          for layers in chunk_layers) + (dispatch if has_moe else 0,)
                for kind, (moe_layer, dispatch) in (routed or {"bound": (layer, 0)}).items()}
        chunk_kept, transient, stage_dispatch = kept[routing if routed else "bound"]
        params, expert_params = stage_param_split(cfg, rank, params_of)
        first, last = rank == 0, rank == pp - 1
        embed = s * b * h * mask_bytes(kernels, e) // r if first and m.hidden_dropout > 0 else 0
        rotary = vpp * 2 * e * s * b * rotary_channels(m)
        logits = int((2 * e * s * b * h + norm_stats_bytes(m, s, b)) / r
                     + 4 * s * b * m.padded_vocab_size / tp) if last else 0
        if last:  # the MTP depths' activations live with the logits (plan/mtp_activations.py)
            last_kind = routed[routing][0] if routed and moe_layers[-1] else layer
            logits += mtp_activation_bytes(cfg, last_kind, logits)
        # The loss's backward makes the logits' gradient, fp32 [s*b, V/t] (and a cast to the model dtype)
        loss_backward = int((4 + (e if e != 4 else 0)) * s * b * m.padded_vocab_size / tp) if last else 0
        chunks = in_flight_chunks(pp, vpp, rank, t.num_micro_batches or 1)
        # Backward starts at the loss (logits alive, their gradient made); a recomputed group's
        # activations come later, once the logits are freed.
        fixed = (embed + rotary) * min(chunks, pp if pp > 1 else 1) + kv_exchange
        peaks = {kind: int(chunks * kept_ + fixed + max(logits + loss_backward, transient_) + dispatch_)
                 for kind, (kept_, transient_, dispatch_) in kept.items()}
        peak = peaks[routing if routed else "bound"]
        unit, expert_unit = largest_fsdp_unit(cfg, rank, params_of)
        root, embedding = fsdp_root_params(cfg, rank, params_of)
        state = stage_state_bytes(cfg, params, expert_params, unit, expert_unit, root=root,
                                  embedding=embedding)
        moments = fsdp_moments(cfg, unit - expert_unit, embedding)  # the dense part's, as state_bytes
        moment = max(moments, key=moments.get)
        out.append(StagePlan(
            pp_rank=rank, params=params, weights_bytes=state.weights, grads_bytes=state.grads,
            optimizer_bytes=state.optimizer, host_bytes=state.host, staging_bytes=state.staging,
            fsdp_held_bytes=state.fsdp_held,
            fsdp_transient_bytes=state.fsdp_transient, fsdp_moment=moment if p.fully_sharded else "",
            gather_transient_bytes=state.gather_transient,
            activation_bytes_per_micro_batch=vpp * (chunk_kept + transient) + embed + rotary + logits,
            layer_activation_bytes=max(layer, routed[routing][0]) if has_moe else layer, logits_bytes=logits,
            in_flight=chunks / vpp, activation_peak_bytes=peak, kv_exchange_bytes=kv_exchange,
            forward_saved_bytes=int(vpp * chunk_kept + embed + rotary + logits),
            expert_params=expert_params, dispatcher_bytes=stage_dispatch,
            balanced_activation_peak_bytes=peaks.get("balanced", peak), routing=routing))
    return out


def _sharding_summary(cfg) -> str:
    p, o = cfg.parallel, cfg.optimizer
    if p.fully_sharded:
        zero = "FSDP2 (ZeRO-3)" if p.fsdp_reshard_after_forward else "FSDP2 without resharding after forward"
    else:
        zero = f"distributed optimizer {'on' if p.use_distributed_optimizer else 'off'}"
    if o.optimizer_cpu_offload:
        zero += f", optimizer CPU offload {o.optimizer_offload_fraction:g}"
    return zero


def _routing_note(st: StagePlan) -> str:
    if not st.dispatcher_bytes:
        return ""
    if st.routing == "balanced":
        return " (routed rows balanced: dropless routing can exceed them)"
    balanced = st.balanced_total_bytes / 2.0**30
    return f" (routed rows at their bound; balanced routing: total {balanced:.2f} GiB)"


def parameters_line(cfg) -> str:
    """The whole model's parameter count; for MoE total and active (per token) and the expert grid."""
    total, active = model_params(cfg)
    moe = moe_settings(cfg)

    def count(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    if moe is None:
        return f"  parameters: {count(total)}"
    ep, etp = expert_sizes(cfg)
    return (f"  parameters: {count(total)} total, {count(active)} active ({moe.moe_router_topk} of "
            f"{moe.num_experts} routed experts per MoE layer); experts on EP {ep} x ETP {etp} x expert-DP "
            f"{expert_data_parallel_size(cfg)}, {moe.moe_token_dispatcher_type} dispatcher")


def iteration_flops(cfg) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs incl. full recompute's extra forward) per iteration, all ranks."""
    model = flops_per_iteration(cfg, cfg.training.global_batch_size)
    m = cfg.model
    if m.recompute_granularity == "full":
        return model, model * 4.0 / 3.0
    return model, model


def format_plan(cfg, stages: list[StagePlan], mfu: float = 0.4, peak_tflops: float = 989.0,
                gpu_memory_gb: float | None = None, step_time: str | None = None) -> str:
    """The plan as printed; `step_time`: the step-time model's line(s) (megafab.plan.report), which
    replace the fixed-MFU estimate."""
    gib = 2.0**30
    p = cfg.parallel
    vpp = f" (VPP {p.virtual_pipeline_model_parallel_size})" if p.virtual_pipeline_model_parallel_size else ""
    lines = [f"megafab plan: world {p.world_size} = TP {p.tensor_model_parallel_size} x PP "
             f"{p.pipeline_model_parallel_size} x DP {p.data_parallel_size}{vpp}"
             + (f" x CP {p.context_parallel_size} ({p.cp_comm_type})" if p.context_parallel_size > 1 else "")
             + f", {cfg.precision.params_dtype_name}, recompute {cfg.model.recompute_granularity or 'none'}, "
             f"{_sharding_summary(cfg)}", parameters_line(cfg)]
    for st in stages:
        fits = ""
        if gpu_memory_gb:
            fits = "  fits" if st.total_bytes / gib <= gpu_memory_gb else \
                f"  DOES NOT FIT {gpu_memory_gb} GiB"
        lines.append(
            f"  stage {st.pp_rank}: params {st.params / 1e6:.1f}M"
            + (f" (routed experts {st.expert_params / 1e6:.1f}M)" if st.expert_params else "")
            + f" | weights {st.weights_bytes / gib:.2f} GiB"
            f" | grads {st.grads_bytes / gib:.2f} GiB | optimizer {st.optimizer_bytes / gib:.2f} GiB"
            + (f" (+ host {st.host_bytes / gib:.2f} GiB"
               + (f", of which async-save staging {st.staging_bytes / gib:.2f} GiB"
                  if st.staging_bytes else "")
               + ")" if st.host_bytes else "")
            + (f" | FSDP2 root gathered/unsharded {st.fsdp_held_bytes / gib:.2f} GiB,"
               f" unit/embedding grads {st.fsdp_transient_bytes / gib:.2f} GiB"
               if st.fsdp_held_bytes or st.fsdp_transient_bytes else "") +
            f" | activations {st.activation_bytes_per_micro_batch / gib:.2f} GiB/micro-batch"
            f" (layer {st.layer_activation_bytes / 2**20:.1f} MiB, logits {st.logits_bytes / gib:.2f} GiB)"
            f" x {st.in_flight:g} in flight"
            + (f" + K/V exchange {st.kv_exchange_bytes / 2**20:.1f} MiB" if st.kv_exchange_bytes else "")
            + (f" + token dispatch {st.dispatcher_bytes / 2**20:.1f} MiB" if st.dispatcher_bytes else "")
            + f" = {st.activation_peak_bytes / gib:.2f} GiB"
            + (f" | all-gather inputs {st.gather_transient_bytes / gib:.2f} GiB"
               if st.gather_transient_bytes else "")
            + f" | total {st.total_bytes / gib:.2f} GiB at the {st.peak_phase}"
            + _routing_note(st) + fits)
    model, hardware = iteration_flops(cfg)
    if step_time is not None:
        lines.append(f"  FLOPs/iteration: model {model:.3e}, with recompute {hardware:.3e}")
        lines.append(step_time)
        return "\n".join(lines)
    seconds = hardware / (p.world_size * peak_tflops * 1e12 * mfu)
    lines.append(f"  FLOPs/iteration: model {model:.3e}, with recompute {hardware:.3e}; at MFU {mfu:g} of "
                 f"{peak_tflops:g} TFLOP/s/GPU: {seconds:.3f} s/iteration")
    return "\n".join(lines)
