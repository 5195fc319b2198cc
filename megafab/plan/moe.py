"""Mixture-of-experts terms of the plan: an MoE layer's parameters as the engine builds them
(megafab.plan.inventory: router, shared experts, the rank's routed experts), its routed rows, what
its MLP keeps for backward and its dispatcher's buffers.

Notation as megafab.plan.planner; E routed experts, k = --moe-router-topk, f_e each expert's width
(--moe-ffn-hidden-size, default f), f_s the shared experts' width, t_e ETP, p_e EP, E_l = E/p_e local
experts; f_1 = 2 f_e with SwiGLU, else f_e (likewise f_s1). Routed experts are reduced and sharded
over expert-DP, the router and shared experts over DP x CP. Active parameters count k of the E
routed experts (what one token passes through); Megatron's compute_weight_and_optimizer_memory
counts the same minus the router (E h per layer, < 0.1%).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megafab.layout import Layout, expert_tensor_parallel_size
from megafab.model.activations import gated_linear_unit
from megafab.model.recompute import RecomputeSettings
from megafab.param_names import ROUTER, SHARED_EXPERTS, parse_index
from megafab.plan.inventory import Inventory
from megafab.plan.state_memory import StateBytes, state_bytes


@dataclass(frozen=True)
class MoEParams:
    """Parameters of one MoE MLP on one rank (or, at tp = etp = ep = 1, in all)."""
    router: int
    shared: int  # shared experts and their gate
    experts: int  # routed experts (param.is_expert): reduced over expert-DP, not DP x CP

    @property
    def total(self) -> int:
        return self.router + self.shared + self.experts


def is_moe_layer(moe, index: int) -> bool:
    """Whether global layer `index` has an MoE MLP (moe: config.moe.moe_settings's value)."""
    return moe is not None and moe.is_moe_layer(index)


def expert_sizes(cfg) -> tuple[int, int]:
    """(EP, ETP) of the config (1, TP for a dense model)."""
    p = cfg.parallel
    return p.expert_model_parallel_size, expert_tensor_parallel_size(p.tensor_model_parallel_size,
                                                                     p.expert_tensor_parallel_size)


def moe_mlp_params(m, moe, tp: int = 1, etp: int = 1, ep: int = 1, experts: int | None = None) -> MoEParams:
    """One MoE MLP on one (TP, ETP, EP) rank, as the engine builds it (megafab.plan.inventory); experts:
    how many routed experts to count in all (default E / ep: the rank's local ones; k for the active
    count)."""
    inv = Inventory(m, moe, tp, etp, ep)
    part = next(p for p in map(inv.layer, range(m.num_layers)) if p.expert)
    count = part.local_experts if experts is None else experts

    def under(prefix: str) -> int:
        return sum(t.numel for t in part.tensors if parse_index(t.name)[1].startswith(prefix))

    return MoEParams(router=under(ROUTER), shared=under(SHARED_EXPERTS),
                     experts=part.expert // part.local_experts * count)


def expert_data_parallel_size(cfg) -> int:
    """Expert-DP: the ranks holding the same experts, world / (ETP x EP x PP) (Megatron's expert
    grid tp-ep-dp-pp, CP folded into its DP): megafab.layout's."""
    return Layout.of(cfg.parallel).edp


_STATE_FIELDS = tuple(f.name for f in dataclasses.fields(StateBytes))


def stage_state_bytes(cfg, params: int, expert_params: int, unit: int, expert_unit: int,
                      root: int = 0, embedding: int = 0) -> StateBytes:
    """Training state of a stage whose `params` include `expert_params` routed-expert ones: the dense
    rest reduced and sharded over DP x CP, the experts over expert-DP (distributed optimizer and
    FSDP2 alike); unit, expert_unit: the largest FSDP2 unit's (all, expert) parameters; root,
    embedding: the root units' parameters and the word embedding among them (dense)."""
    dense = state_bytes(cfg, params - expert_params, unit - expert_unit, root=root, embedding=embedding)
    if not expert_params:
        return dense
    experts = state_bytes(cfg, expert_params, expert_unit, group_size=expert_data_parallel_size(cfg))
    return StateBytes(*(getattr(dense, name) + getattr(experts, name) for name in _STATE_FIELDS))


def router_tokens(cfg) -> int:
    """N: tokens entering one rank's router per micro-batch (the SP shard of its CP chunk)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    r = p.tensor_model_parallel_size if p.sequence_parallel else 1
    return t.micro_batch_size * m.seq_length // p.context_parallel_size // r


def expected_rows(cfg, moe) -> int:
    """Routed rows one rank's experts take per micro-batch under balanced routing."""
    _, etp = expert_sizes(cfg)
    return router_tokens(cfg) * moe.moe_router_topk * etp


def bound_rows(cfg, moe) -> int:
    """The most routed rows one rank's experts can take per micro-batch. With N tokens entering each
    rank's router (router_tokens) the expected rows are N k t_e (balanced routing; the step time uses
    them); the bound is N p_e t_e min(k, E_l) without a capacity factor (every token of the EP x ETP
    group picks this rank's experts: the memory plan's worst case), and with
    --moe-expert-capacity-factor cf E_l p_e t_e ceil(N k / E cf) (each source rank sends each expert
    at most its capacity; exactly that with padding)."""
    ep, etp = expert_sizes(cfg)
    n, k, experts = router_tokens(cfg), moe.moe_router_topk, moe.num_experts
    local = experts // ep
    worst = n * ep * etp * min(k, local)
    cf = moe.moe_expert_capacity_factor
    if cf is None:
        return worst
    capped = local * ep * etp * math.ceil(n * k / experts * cf)
    return capped if moe.moe_pad_expert_input_to_capacity else min(capped, worst)


def moe_mlp_activation_bytes(cfg, moe, rows: int, e: int) -> int:
    """What one MoE MLP keeps for backward per micro-batch on one rank, beyond the normed input the
    dense layer already counts (the router's and shared experts' input):
        router          N (12 k + E (1 + e))      the chosen experts (int64) and their fp32 softmax,
                                                 the routing map (bool) and probabilities [E, N]
        routed rows     rows (2 e h + e (f_1 + 2 f_e + f_e with SwiGLU) / t_e + 8 + e)
                                                 expert input, the experts' output kept by the
                                                 combine, fc1 output, activation output (for the
                                                 probabilities' gradient), fc2 input; the row's
                                                 permutation index and probability (fc2's bias,
                                                 --add-bias-linear, is added per expert as
                                                 megatron-core's _apply_bias: bias * probs keeps
                                                 the parameter and the probabilities, no rows)
        shared experts  e s b / c (f_s1 + f_s + f_s with SwiGLU) / t    as the dense MLP
    Selective recompute: moe keeps nothing beyond that input (0); shared_experts drops the shared
    term; moe_act keeps of each row's activation only fc1's output (e (2 f_e + f_e with SwiGLU) / t_e
    less per row: the activation's intermediates and fc2's input are recomputed).
    """
    recompute = RecomputeSettings.from_model_config(cfg.model, check=False)
    if recompute.selects("moe"):
        return 0
    m, p, t = cfg.model, cfg.parallel, cfg.training
    _, etp = expert_sizes(cfg)
    tp = p.tensor_model_parallel_size
    h, f_e = m.hidden_size, moe.ffn_hidden_size(m.ffn_hidden_size)
    gated = gated_linear_unit(m)
    fc1 = f_e * (2 if gated else 1)
    router = router_tokens(cfg) * (12 * moe.moe_router_topk + moe.num_experts * (1 + e))
    # moe_act: the activation's intermediates and output recomputed from fc1's output
    act = 0 if recompute.selects("moe_act") and moe.moe_grouped_gemm else 2 * f_e + (f_e if gated else 0)
    per_row = 2 * e * h + e * (fc1 + act) // etp + 8 + e
    shared = 0
    f_s = moe.moe_shared_expert_intermediate_size
    if f_s and not recompute.selects("shared_experts"):
        tokens = t.micro_batch_size * m.seq_length // p.context_parallel_size
        shared = e * tokens * (f_s * (2 if gated else 1) + f_s + (f_s if gated else 0)) // tp
    return router + rows * per_row + shared


def dispatcher_bytes(cfg, moe, rows: int, e: int) -> int:
    """Transient buffers of one MoE layer's dispatch (in the peak, one layer at a time): alltoall,
    the permuted tokens sent (N k h) and the rows received before the ETP all-gather (rows / t_e);
    allgather, the EP x ETP group's gathered tokens, their fp32 probabilities and routing map."""
    ep, etp = expert_sizes(cfg)
    n, h = router_tokens(cfg), cfg.model.hidden_size
    if moe.moe_token_dispatcher_type == "alltoall":
        return e * h * (n * moe.moe_router_topk + rows // etp)
    gathered = n * ep * etp
    return gathered * (e * h + 5 * moe.num_experts)
