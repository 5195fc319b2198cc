"""Parameters per layer, chunk, pipeline stage and model on one rank, counted on the parts the engine
builds (megafab.plan.inventory): the planner's, FSDP2's and the step-time model's counts.

A rank of stage i holds its chunks' layers (PipelineSplit) and their ends: the embedding on the first
chunk of stage 0, the final norm and output layer on the last chunk of the last stage (a tied output
layer is the embedding's copy there). Routed-expert parameters (param.is_expert) are counted apart:
they are reduced and sharded over expert-DP, the rest over DP x CP.
"""

from __future__ import annotations

from megafab.config.moe import moe_settings
from megafab.param_names import WORD_EMBEDDING
from megafab.pipeline_split import PipelineSplit
from megafab.plan.inventory import Ends, Inventory, Part
from megafab.plan.moe import expert_sizes


def inventory(cfg, tp: int | None = None, etp: int | None = None, ep: int | None = None) -> Inventory:
    """The config's model on a rank of its own layout (or of the sizes given)."""
    own_ep, own_etp = expert_sizes(cfg)
    tp = cfg.parallel.tensor_model_parallel_size if tp is None else tp
    etp, ep = own_etp if etp is None else etp, own_ep if ep is None else ep
    return Inventory(cfg.model, moe_settings(cfg), tp, etp, ep)


def _split(part: Part, experts: int | None = None) -> tuple[int, int]:
    """(all, expert) parameters of a layer; experts: how many of its routed experts to count (default
    the rank's local ones)."""
    if experts is None or not part.expert:
        return part.total, part.expert
    counted = part.expert // part.local_experts * experts
    return part.total - part.expert + counted, counted


def layer_params(m, tp: int) -> int:
    """Parameters of one dense transformer layer on one TP rank."""
    return Inventory(m, None, tp).layer(0).total


def layer_param_split(cfg, index: int, tp: int, etp: int = 1, ep: int = 1,
                      experts: int | None = None) -> tuple[int, int]:
    """(all, expert) parameters of global layer `index` on one rank; experts: how many routed experts
    to count in all (default the rank's E / ep; k for the active count)."""
    return _split(inventory(cfg, tp, etp, ep).layer(index), experts)


def fsdp_layer_units(cfg, index: int, tp: int, etp: int = 1, ep: int = 1) -> list[tuple[int, int]]:
    """FSDP2's groups of global layer `index` on one rank (megafab.distributed.fsdp.layer_units and
    expert_units), each (parameters sharded over DP x CP, over expert-DP): the layer itself (its
    norms), its attention block, its MLP (an MoE layer's router and shared experts) and an MoE
    layer's routed experts, a group of their own over expert-DP; together layer_param_split's."""
    return list(inventory(cfg, tp, etp, ep).layer(index).units)


def chunk_params(m, tp: int, layers: int, pre_process: bool, post_process: bool) -> int:
    """A chunk of `layers` dense layers on one TP rank, with its ends."""
    inv = Inventory(m, None, tp)
    return (layers * inv.layer(0).total if layers else 0) + inv.ends(pre_process, post_process).total


class LayerParams:
    """The config's layers and ends on one rank, looked up once per layer (the layout search plans
    thousands of candidates; the parts themselves are built once per kind)."""

    def __init__(self, cfg):
        self.inventory = inventory(cfg)
        self.split = PipelineSplit.from_config(cfg)
        self.pp = cfg.parallel.pipeline_model_parallel_size
        self.moe_layer = [self.inventory.layer(i).expert > 0 for i in range(cfg.model.num_layers)]
        self.chunks: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def layer(self, index: int) -> tuple[int, int]:
        return _split(self.inventory.layer(index))

    def chunk(self, pp_rank: int, chunk: int) -> list[tuple[int, int]]:
        """(all, expert) parameters of each layer of one model chunk, in order."""
        if (pp_rank, chunk) not in self.chunks:
            layers = range(*self.split.layer_range(pp_rank, chunk))
            self.chunks[pp_rank, chunk] = [self.layer(i) for i in layers]
        return self.chunks[pp_rank, chunk]

    def chunk_count(self, pp_rank: int) -> int:
        return len(self.split.counts()[pp_rank])

    def ends(self, pp_rank: int, chunk: int) -> Ends:
        last = self.chunk_count(pp_rank) - 1
        return self.inventory.ends(pp_rank == 0 and chunk == 0, pp_rank == self.pp - 1 and chunk == last)


def stage_param_split(cfg, pp_rank: int, layers: LayerParams | None = None) -> tuple[int, int]:
    """(all, expert) parameters of pipeline stage `pp_rank` on one rank (all its chunks); layers:
    the config's LayerParams, if made already."""
    layers = layers or LayerParams(cfg)
    total = _stage_ends_params(layers, pp_rank)
    expert = sum(layers.ends(pp_rank, c).tail.expert for c in range(layers.chunk_count(pp_rank)))  # MoE MTP
    for c in range(layers.chunk_count(pp_rank)):
        for n, x in layers.chunk(pp_rank, c):
            total, expert = total + n, expert + x
    return total, expert


def _stage_ends_params(layers: LayerParams, pp_rank: int) -> int:
    """The stage's chunks' embedding, final norm and output layer on one rank: FSDP2's root units."""
    return sum(layers.ends(pp_rank, c).total for c in range(layers.chunk_count(pp_rank)))


def stage_params(cfg, pp_rank: int) -> int:
    return stage_param_split(cfg, pp_rank)[0]


def model_params(cfg) -> tuple[int, int]:
    """(total, active) parameters of the whole model: active counts the k routed experts a token
    passes through of each MoE layer (equal for a dense model)."""
    inv, moe = inventory(cfg, 1, 1, 1), moe_settings(cfg)
    tail = inv.ends(True, True).tail
    ends = inv.ends(True, True).total
    layers = [inv.layer(i) for i in range(cfg.model.num_layers)]
    total = ends + sum(part.total for part in layers)
    if moe is None:
        return total, total
    if tail.expert:  # MoE MTP layers (of the last layer's kind): k routed experts of each are active
        ends += tail.expert // layers[-1].expert * _split(layers[-1], moe.moe_router_topk)[1] - tail.expert
    return total, ends + sum(_split(part, moe.moe_router_topk)[0] for part in layers)


def largest_fsdp_unit(cfg, pp_rank: int, layers: LayerParams | None = None) -> tuple[int, int]:
    """FSDP2's largest group below the chunks' roots on the stage, (all, expert) parameters: a
    dense layer's largest group (its attention block or MLP), or an MoE layer (its dense part and
    its routed experts, counted together); layers: see stage_param_split."""
    layers = layers or LayerParams(cfg)
    units = [(0, 0)]
    for c in range(layers.chunk_count(pp_rank)):
        for index in range(*layers.split.layer_range(pp_rank, c)):
            part = layers.inventory.layer(index)
            units.append(_split(part) if part.expert else max(part.units))
    return max(units)


def fsdp_root_params(cfg, pp_rank: int, layers: LayerParams | None = None) -> tuple[int, int]:
    """(parameters of the stage's FSDP2 roots: each chunk's embedding, final norm and output layer;
    its word embedding's parameters, whose gradient the end of backward makes)."""
    layers = layers or LayerParams(cfg)
    embedding = sum(t.numel for c in range(layers.chunk_count(pp_rank))
                    for t in layers.ends(pp_rank, c).head.tensors if t.name == WORD_EMBEDDING)
    return _stage_ends_params(layers, pp_rank), embedding
