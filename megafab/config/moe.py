"""The mixture-of-experts section of the configuration (`cfg.moe`): megatron-core 0.16.1's MoE flags
and the rules they must keep.

Field names are the `dest` of Megatron-LM's flags (``--num-experts`` -> ``num_experts``). The MoE
layer takes this section as its settings (megafab/model/moe/settings.py names it `MoESettings`), so
code and tests build it by keywords as well; `problems()` states every MoE rule once, one line each,
in the wording of the configuration's one error message, and checks its own choices for that reason.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from megafab.config.fields import Section, option

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = (None, "fp32", "fp64")
BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("allgather", "alltoall")
# Megatron's choices: what the parser accepts; problems() refuses the ones megafab has not by name.
MEGATRON_DISPATCHERS = ("allgather", "alltoall", "flex")
GROUP = "moe"
# Sizes that are an error without --num-experts (Megatron asserts); the other MoE flags then do nothing.
NEEDS_EXPERTS = ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")


def parse_layer_freq(text, flag: str) -> int | tuple[int, ...]:
    """A per-layer frequency flag as Megatron's moe_freq_type reads it: "N" (every N-th layer), or a
    pattern expression of int lists, + and * such as "([0]*1+[1]*3)*2" (evaluated without eval).
    ValueError naming `flag` if neither (--moe-layer-freq, --window-attn-skip-freq)."""
    text = str(text).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{flag} {text!r} is neither an int nor a pattern like "
                             f"'([0]*1+[1]*3)'") from None
    try:
        value = _pattern_value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        value = None
    if not isinstance(value, list):
        raise ValueError(f"{flag} {text!r} is not a pattern of int lists joined by + and "
                         f"repeated by *, like '([0]*1+[1]*3)'")
    return tuple(value)


def parse_moe_layer_freq(text) -> int | tuple[int, ...]:
    """--moe-layer-freq as Megatron reads it (parse_layer_freq)."""
    return parse_layer_freq(text, "--moe-layer-freq")


parse_moe_layer_freq.__name__ = "moe_freq_type"  # Megatron's name for the type, shown by argparse


@dataclass
class MoEConfig(Section):
    num_experts: int | None = option(
        None, group=GROUP, help="Routed experts per MoE layer; unset: a dense model.")
    moe_layer_freq: int | tuple[int, ...] = option(
        1, group=GROUP, parse=parse_moe_layer_freq,
        help="Which layers are MoE: every N-th layer (1: all), or a per-layer 0/1 pattern such as "
             "'([0]*1+[1]*3)' (1: MoE, 0: dense).")
    moe_ffn_hidden_size: int | None = option(
        None, help="Each routed expert's inner width; default --ffn-hidden-size.")
    moe_router_topk: int = option(2, help="Experts each token is routed to.")
    moe_router_score_function: str = option(
        "softmax", choices=SCORE_FUNCTIONS, help="Router scores: softmax or sigmoid.")
    moe_router_pre_softmax: bool = option(
        False, help="Softmax (sigmoid) before the top-k selection instead of over the k chosen logits.")
    moe_router_topk_scaling_factor: float | None = option(
        None, help="Multiplies the chosen routing probabilities.")
    moe_router_num_groups: int | None = option(
        None, help="Group-limited routing: the experts form this many equal groups.")
    moe_router_group_topk: int | None = option(
        None, help="Group-limited routing: each token chooses its experts from this many groups.")
    moe_router_dtype: str | None = option(
        None, choices=("fp32", "fp64"),
        help="fp32 or fp64: the dtype of the router's logits, scores and the probabilities the experts "
             "apply; default the model's dtype.")
    moe_input_jitter_eps: float | None = option(
        None, help="Multiply the router's input by uniform noise in [1 - eps, 1 + eps] while training.")
    moe_router_enable_expert_bias: bool = option(
        False,
        help="Aux-loss-free balancing: a per-expert bias (sigmoid scores only), added for the selection "
             "only, that follows the tokens per expert after each step.")
    moe_router_bias_update_rate: float = option(
        1e-3, help="Step of the expert bias after each optimizer step, toward the mean tokens per expert.")
    moe_router_load_balancing_type: str | tuple[str, ...] = option(
        "aux_loss", group=GROUP, nargs="+", choices=BALANCING_TYPES,
        help="Balancing loss: aux_loss (per micro-batch), seq_aux_loss (per sequence), global_aux_loss "
             "(over the global batch) or none; or several, each with its --moe-aux-loss-coeff; or "
             "sinkhorn alone (S-BASE: the experts chosen by a Sinkhorn normalisation over each rank's "
             "tokens while training, no auxiliary loss).")
    moe_aux_loss_coeff: float | tuple[float, ...] = option(
        0.0, group=GROUP, nargs="+", parse=float,
        help="Weight of the balancing loss (one per --moe-router-load-balancing-type when several).")
    moe_z_loss_coeff: float | None = option(
        None, help="Weight of the router z-loss (mean squared log-sum-exp of the logits).")
    moe_expert_capacity_factor: float | None = option(
        None,
        help="Tokens an expert takes at most: ceil(tokens * topk / experts * factor), the rest dropped; "
             "unset: no dropping.")
    moe_pad_expert_input_to_capacity: bool = option(
        False, help="Pad every expert's input to its capacity (needs --moe-expert-capacity-factor).")
    moe_token_drop_policy: str = option(
        "probs", choices=DROP_POLICIES,
        help="Over capacity, drop the lowest-probability tokens (probs) or the last ones (position).")
    moe_grouped_gemm: bool = option(
        False,
        help="The local experts' GEMMs as one grouped matmul (torch's, where the installed torch has "
             "one; else one GEMM per expert, the same numbers).")
    moe_shared_expert_intermediate_size: int | None = option(
        None,
        help="Width of the shared experts every token also passes through (number of shared experts x "
             "each one's width); unset: no shared experts.")
    moe_shared_expert_gate: bool = option(
        False, help="Scale the shared experts' output by a learned sigmoid gate per token.")
    moe_shared_expert_overlap: bool = option(
        False, help="Overlap the shared experts with the dispatcher's communication (alltoall only).")
    moe_token_dispatcher_type: str = option(
        "allgather", choices=MEGATRON_DISPATCHERS,
        help="How tokens reach their experts over the expert-parallel group: allgather or alltoall "
             "(flex, DeepEP / HybridEP, is refused).")
    moe_permute_fusion: bool = option(
        False, help="Transformer Engine's fused token permutation (with --transformer-impl "
                    "transformer_engine; local layers permute unfused, the same values).")
    moe_router_force_load_balancing: bool = option(
        False,
        help="[Experimental] Force load balancing with random logits for MoE router, supports naive "
             "topk and group-limited topk. This is an experimental feature and only for benchmark "
             "(megatron-core's: standard-normal logits replace the gate's, its gradient passed "
             "through unchanged).")
    moe_layer_recompute: bool = option(
        False,
        help="Enable checkpointing for moe_layer, should be used when memory is not sufficient. Deprecated. "
             "Use \"--recompute-granularity selective --recompute-modules moe\" instead (which it sets, "
             "as megatron-core does).")
    moe_per_layer_logging: bool = option(
        False,
        help="Enable per-layer logging for MoE, currently supports auxiliary loss and z loss "
             "(TensorBoard and W&B: moe/<loss>_layer_<i>, i over all layers).")

    @property
    def balancing_types(self) -> tuple[str, ...]:
        kind = self.moe_router_load_balancing_type
        return (kind,) if isinstance(kind, str) else tuple(kind)

    @property
    def aux_loss_coeffs(self) -> tuple[float, ...]:
        coeff = self.moe_aux_loss_coeff
        return (coeff,) if isinstance(coeff, (int, float)) else tuple(coeff)

    def aux_loss_coeff(self, kind: str) -> float:
        """The coefficient of one balancing type; 0 when that type is not asked for."""
        for name, coeff in zip(self.balancing_types, self.aux_loss_coeffs):
            if name == kind:
                return float(coeff)
        return 0.0

    def ffn_hidden_size(self, dense_ffn_hidden_size: int) -> int:
        return self.moe_ffn_hidden_size or dense_ffn_hidden_size

    def problems(self, num_layers: int | None = None, expert_parallel_size: int = 1) -> list[str]:
        """Every rule these settings break, one line each (value, rule, fix)."""
        if self.num_experts is None:
            return [f"--{name.replace('_', '-')} needs --num-experts" for name in NEEDS_EXPERTS
                    if getattr(self, name) is not None]
        out: list[str] = []
        experts, topk = self.num_experts, self.moe_router_topk
        if experts < 1:
            return [f"--num-experts {experts} must be at least 1"]
        if not 1 <= topk <= experts:
            out.append(f"--moe-router-topk {topk} must be between 1 and --num-experts {experts}")
        if experts % expert_parallel_size:
            out.append(f"--num-experts {experts} is not divisible by --expert-model-parallel-size "
                       f"{expert_parallel_size}; every EP rank holds the same number of experts")
        out += self._choice_problems()
        out += self._group_routing_problems()
        out += self._sinkhorn_problems()
        if topk == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax \
                and self.moe_router_load_balancing_type != "sinkhorn":  # megatron-core's rule, word for word
            out.append("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a softmax "
                       "over one chosen logit is 1 and has no gradient)")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            out.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            out.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and shared <= 0:
            out.append(f"--moe-shared-expert-intermediate-size {shared} "
                       f"must be positive (num shared experts x each one's width)")
        if self.moe_shared_expert_overlap and self.moe_token_dispatcher_type != "alltoall":
            out.append("--moe-shared-expert-overlap works only with --moe-token-dispatcher-type alltoall")
        if num_layers is not None:
            out += self._layer_freq_problems(num_layers)
        return out

    def _choice_problems(self) -> list[str]:
        out = []
        if self.moe_token_dispatcher_type == "flex":
            out.append("--moe-token-dispatcher-type flex (DeepEP / HybridEP, GPU-only kernels) is not "
                       "supported by megafab; use alltoall or allgather")
        elif self.moe_token_dispatcher_type not in DISPATCHERS:
            out.append(f"--moe-token-dispatcher-type {self.moe_token_dispatcher_type} must be one of "
                       f"{', '.join(DISPATCHERS)}")
        choices = (("--moe-router-score-function", self.moe_router_score_function, SCORE_FUNCTIONS),
                   ("--moe-router-dtype", self.moe_router_dtype, ROUTER_DTYPES),
                   ("--moe-token-drop-policy", self.moe_token_drop_policy, DROP_POLICIES))
        for flag, value, allowed in choices:
            if value not in allowed:
                out.append(f"{flag} {value} must be one of {', '.join(str(a) for a in allowed if a)}")
        for kind in self.balancing_types:
            if kind not in BALANCING_TYPES:
                out.append(f"--moe-router-load-balancing-type {kind} must be one of "
                           f"{', '.join(BALANCING_TYPES)}")
        if len(self.balancing_types) != len(self.aux_loss_coeffs):
            out.append(f"--moe-aux-loss-coeff has {len(self.aux_loss_coeffs)} value(s) for "
                       f"{len(self.balancing_types)} --moe-router-load-balancing-type(s); give one each")
        return out

    def _sinkhorn_problems(self) -> list[str]:
        """megatron-core's sinkhorn routing asserts a zero aux-loss coefficient and no capacity, runs
        only as the one balancing type (in a list it is skipped) and ignores the other routing
        choices (refused here, one line each)."""
        if "sinkhorn" not in self.balancing_types:
            return []
        if len(self.balancing_types) > 1:
            return ["--moe-router-load-balancing-type sinkhorn cannot be combined with other types "
                    "(megatron-core then skips sinkhorn routing); give sinkhorn alone"]
        with_sinkhorn = "with --moe-router-load-balancing-type sinkhorn"
        ignored = "megatron-core's sinkhorn ignores it; drop it"
        out = []
        if self.aux_loss_coeff("sinkhorn"):
            out.append(f"--moe-aux-loss-coeff {self.moe_aux_loss_coeff} must be 0 {with_sinkhorn} (it has "
                       f"no auxiliary loss; megatron-core asserts it); drop --moe-aux-loss-coeff")
        if self.moe_expert_capacity_factor is not None:
            out.append(f"--moe-expert-capacity-factor {self.moe_expert_capacity_factor} {with_sinkhorn}: "
                       f"megatron-core drops tokens only with aux_loss, seq_aux_loss, global_aux_loss or "
                       f"none; drop --moe-expert-capacity-factor")
        if self.moe_router_score_function != "softmax":
            out.append(f"--moe-router-score-function {self.moe_router_score_function} has no effect "
                       f"{with_sinkhorn} (its scores: sigmoid at --moe-router-topk 1, softmax above); "
                       f"{ignored}")
        for flag, value in (("--moe-router-pre-softmax", self.moe_router_pre_softmax),
                            ("--moe-router-group-topk", self.moe_router_group_topk),
                            ("--moe-router-topk-scaling-factor", self.moe_router_topk_scaling_factor),
                            ("--moe-router-enable-expert-bias", self.moe_router_enable_expert_bias)):
            if value:
                shown = "" if value is True else f" {value}"
                out.append(f"{flag}{shown} has no effect {with_sinkhorn}; {ignored}")
        return out

    def sinkhorn_layout_note(self, tp: int, sequence_parallel: bool, cp: int) -> str | None:
        """The start-up note when sinkhorn routing depends on the layout: under SP or CP each rank's
        router normalises only its own slice of the sequences (megatron-core's; model/moe/sinkhorn.py)."""
        if self.num_experts is None or self.moe_router_load_balancing_type != "sinkhorn":
            return None
        sp = tp if sequence_parallel and tp > 1 else 1
        splits = ([f"--sequence-parallel (TP {tp})"] if sp > 1 else []) + \
            ([f"--context-parallel-size {cp}"] if cp > 1 else [])
        if not splits:
            return None
        return (f"--moe-router-load-balancing-type sinkhorn with {' and '.join(splits)}: each rank's router "
                f"normalises over its own 1/{sp * cp} of each micro-batch's tokens, as megatron-core does, "
                f"so the experts chosen while training depend on this layout")

    def _group_routing_problems(self) -> list[str]:
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if not group_topk:
            return []
        if not groups:
            return ["--moe-router-group-topk needs --moe-router-num-groups"]
        experts, topk = self.num_experts, self.moe_router_topk
        if experts % groups:
            return [f"--num-experts {experts} is not divisible by --moe-router-num-groups {groups}"]
        out = []
        if group_topk > groups:
            out.append(f"--moe-router-group-topk {group_topk} is larger than --moe-router-num-groups "
                       f"{groups}")
        if topk % group_topk:
            out.append(f"--moe-router-topk {topk} is not divisible by --moe-router-group-topk {group_topk} "
                       f"(each chosen group is scored by its top topk/group_topk experts)")
        elif topk // group_topk > experts // groups:
            out.append(f"--moe-router-topk {topk} needs {topk // group_topk} experts per group, but a group "
                       f"has {experts // groups} (--num-experts / --moe-router-num-groups)")
        return out

    def _layer_freq_problems(self, num_layers: int) -> list[str]:
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return [] if freq >= 1 else [f"--moe-layer-freq {freq} must be at least 1"]
        if len(freq) != num_layers:
            return [f"--moe-layer-freq pattern has {len(freq)} entries for --num-layers {num_layers}; "
                    f"give one 0/1 per layer"]
        if any(v not in (0, 1) for v in freq):
            return ["--moe-layer-freq pattern entries must be 0 (dense) or 1 (MoE)"]
        return []

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether layer `layer_index` (0-based, over the whole model) has an MoE MLP."""
        if self.num_experts is None:
            return False
        freq = self.moe_layer_freq
        return layer_index % freq == 0 if isinstance(freq, int) else bool(freq[layer_index])


def _pattern_value(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        values = [_pattern_value(e) for e in node.elts]
        if not all(type(v) is int for v in values):
            raise ValueError("a pattern list holds ints")
        return values
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and {type(left), type(right)} == {list, int}:
            return left * right if isinstance(left, list) else right * left
    raise ValueError("not a layer pattern")


def moe_settings(cfg) -> MoEConfig | None:
    """The config's MoE settings (its moe section), None for a dense model."""
    return cfg.moe if cfg.moe.num_experts is not None else None
