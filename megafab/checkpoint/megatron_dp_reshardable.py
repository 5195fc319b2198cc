"""Megatron-LM's default distributed-optimizer state (`dp_reshardable`) read into any megafab layout.

megatron-core 0.16.1 (DistributedOptimizer.sharded_param_state_dp_reshardable) saves Adam's state
as its DDP buffers hold it: one flat tensor per (model-parallel rank G, buffer I, bucket B, kind),
`optimizer.distributed.dp_group_idx_G.gbuf_idx_I.dtype_(param, grad).bucket_idx_B.{param, exp_avg,
exp_avg_sq}` of the bucket's unpadded size (`param`: the fp32 main copy), G = tp + TP * pp; with
expert parallelism the routed experts' buffers are a second optimizer's (keys `chained_1.`, G =
etp + ETP * (ep + EP * pp); the dense ones `chained_0.`). Adam's step is in the pickled
`...optimizer` object. A bucket is _ParamAndGradBuffer's: a model chunk's parameters in reverse
named_parameters order (MCORE_LAYER_ORDER), each starting at a multiple of 64, closed once it holds
bucket_size elements (the pipeline-shared embedding alone), padded to lcm(DP, 128) at its end, which
the saved tensors leave out. The layout is re-derived from the saved args (_bucket_size: Megatron-LM's
get_model and DDP rules) and checked against the checkpoint (each bucket's size, each parameter on
its stored pieces); each flat range is a parameter's TP block (layout.ParamLayout), so any layout
reads the boxes it owns, only the rows it needs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from megafab.checkpoint import safe_pickle
from megafab.checkpoint.boxes import Box
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import (
    MAIN_PARAM,
    MODEL_PREFIX,
    ExpertPlacement,
    ParamLayout,
    Shard,
    optim_key,
    param_layout,
    split_key,
    strided_dim,
)
from megafab.config.derive import default_bucket_size
from megafab.param_names import (
    EXPERT_BIAS,
    EXPERTS,
    OUTPUT_LAYER,
    experts_name,
    is_routed_expert,
    parse_index,
    sequential_expert_name,
    te_to_local_name,
    tp_partition,
)
from megafab.pipeline_split import PipelineSplit

SHARDING = "dp_reshardable"
# ChainedOptimizer prefixes its members' keys `chained_<i>.` (the dense optimizer, then with expert
# parallelism the experts'); one optimizer has none.
BUCKET_KEY = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)"
                        r"\.dtype_\(.*\)\.bucket_idx_(\d+)\.(\w+)$")
OPTIMIZER_OBJECT = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"  # Adam's step, param_groups
SCALER_OBJECT = "optimizer.distributed.dp_group_idx_0.grad_scaler/shard_0_1"  # fp16's loss scaler
BUCKET_KIND = {MAIN_PARAM: "param"}  # megafab kind -> the bucket tensor's (the moments keep theirs)
PARAM_ALIGN = 64  # _pad_start_of_param_if_needed
BUCKET_ALIGN, HIGH_BUSBW_ALIGN = 128, 2 ** 16  # _pad_end_of_bucket_if_needed: lcm(DP, 128[, 2^16])
PRE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
POST = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", OUTPUT_LAYER)
_LINEAR, _MLP = ("weight", "bias"), ("linear_fc1", "linear_fc2")
_ATTENTION = tuple(f"self_attention.{m}.{p}" for m in ("linear_proj", "linear_qkv") for p in _LINEAR)
_INPUT_NORM = ("input_layernorm.weight", "input_layernorm.bias")
_REST = ("self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
         "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
         "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", "mlp.router.weight", "mlp.router.bias",
         EXPERTS, *(f"mlp.shared_experts.{m}.{p}" for m in _MLP for p in _LINEAR),
         "mlp.shared_experts.gate_weight", *(f"mlp.{m}.{p}" for m in _MLP for p in _LINEAR))
# A transformer layer's parameters (local names) in megatron-core's named_parameters order, i.e.
# module registration: the local spec's input norm first, Transformer Engine's fused into linear_qkv
# after linear_proj; EXPERTS: a SequentialMLP's local experts in turn, each EXPERT_ORDER.
MCORE_LAYER_ORDER = {"local": _INPUT_NORM + _ATTENTION + _REST,
                     "transformer_engine": _ATTENTION[:2] + _INPUT_NORM + _ATTENTION[2:] + _REST}
EXPERT_ORDER = tuple(f"{m}.{p}" for m in _MLP for p in _LINEAR)
# Saved runs whose buffers this reader does not lay out (each a flag and its default)
UNREAD = (("num_distributed_optimizer_instances", 1), ("overlap_param_gather_with_optimizer_step", False),
          ("mtp_num_layers", None), ("multi_latent_attention", False), ("moe_grouped_gemm", False),
          ("use_megatron_fsdp", False), ("use_precision_aware_optimizer", False))


@dataclass(frozen=True)
class Placed:
    """A parameter of the saving job: its TP block, at [start, start + numel) of bucket `bucket`
    (its key without the kind)."""

    layout: ParamLayout
    bucket: str
    start: int


def args_problem(args: dict) -> str | None:
    """Why the saved run's buckets cannot be laid out here (None: they can)."""
    if (args.get("expert_model_parallel_size") or 1) == 1 and \
            args.get("expert_tensor_parallel_size") not in (None, args.get("tensor_model_parallel_size")):
        return (f"its {SHARDING} optimizer state comes from a run with --expert-tensor-parallel-size "
                f"{args['expert_tensor_parallel_size']} other than its TP at EP 1; megafab does not read it "
                f"yet")
    for name, default in UNREAD:
        if args.get(name) not in (default, None) and not (default is None and args.get(name) == 0):
            return (f"its {SHARDING} optimizer state comes from a run with --{name.replace('_', '-')} "
                    f"{args.get(name)!r}, whose bucket layout megafab does not read yet (save it with "
                    f"--dist-ckpt-optim-fully-reshardable for a state megafab reads)")
    return None


def _local_shape(name: str, stored: tuple, tp: int, swiglu: bool) -> tuple:
    """megatron-core's shape of parameter `name` (a routed expert: one sequential expert's) on a rank
    of TP (or expert-TP) degree `tp`, from the global shape a megafab view stores."""
    shape = list(stored)
    dim = strided_dim(experts_name(name), swiglu)
    if dim is not None:  # [.., 2, f, ..] -> [.., 2f, ..]
        shape[dim:dim + 2] = [shape[dim] * shape[dim + 1]]
    if is_routed_expert(name):
        shape = shape[1:]
    split = tp_partition(name, swiglu)
    if split is not None:
        shape[split[0]] //= tp
    return tuple(shape)


def _layout(name: str, stored: tuple, tp: int, tp_rank: int, swiglu: bool, experts) -> ParamLayout:
    """The ParamLayout megafab's own parameter would have on that rank (a meta stand-in)."""
    p = torch.empty(_local_shape(name, stored, tp, swiglu), device="meta")
    split = tp_partition(name, swiglu)
    p.tensor_model_parallel = split is not None
    if split is not None:
        p.partition_dim, p.partition_stride = split
    return param_layout(name, p, tp, tp_rank, experts)


def _layer_names(names, layer: int, order: tuple, experts: int, part: str) -> list[str]:
    """Layer `layer`'s parameters of `names` (view names) in megatron-core's order; part "dense"
    leaves out the routed experts, "experts" keeps only them (local experts 0 .. experts - 1)."""
    rank = {suffix: i for i, suffix in enumerate(order)}
    keyed = []
    for name in names:
        parsed = parse_index(name)
        if parsed is None or parsed[0] != layer or parsed[1] == EXPERT_BIAS:
            continue
        suffix = te_to_local_name(parsed[1]) or parsed[1]
        if suffix.startswith(EXPERTS):
            rest = suffix[len(EXPERTS):]
            keyed += [((rank[EXPERTS], e, EXPERT_ORDER.index(rest)), sequential_expert_name(name, e))
                      for e in range(experts) if part != "dense"]
        elif suffix not in rank:
            raise CheckpointError(f"its parameter {name!r} has no known place in megatron-core's "
                                  f"{SHARDING} buckets")
        elif part != "experts":
            keyed.append(((rank[suffix], 0, 0), name))
    return [name for _, name in sorted(keyed)]


def chunk_names(names, split: PipelineSplit, pp_rank: int, chunk: int, impl: str, experts: int,
                tied: bool, part: str = "all") -> list[tuple[str, bool, bool]]:
    """(name, shared_embedding, copy) of a model chunk's trainable parameters in named_parameters
    order (part: all, "dense" or "experts", the expert-parallel buffer's); a tied output layer's
    copy (pipeline-parallel: its state is the embedding's) under the embedding's name, copy True."""
    first, last = split.layer_range(pp_rank, chunk)
    pre, post = pp_rank == 0 and chunk == 0, pp_rank == split.pp - 1 and chunk == split.vpp - 1
    shared, outer = tied and split.pp > 1, part != "experts"
    out = [(n, shared and n == PRE[0], False) for n in PRE if outer and pre and n in names]
    for layer in range(first, last):
        out += [(n, False, False) for n in _layer_names(names, layer, MCORE_LAYER_ORDER[impl], experts, part)]
    out += [(n, False, False) for n in POST if outer and post and n in names]
    if outer and post and shared:
        out.append((PRE[0], True, True))
    return out


def bucket_starts(numels: list[int], shared: list[bool], bucket_size: int | None,
                  align: int) -> tuple[list[tuple[int, int]], list[int]]:
    """_ParamAndGradBuffer's layout of parameters (named_parameters order): per parameter (bucket,
    start in the bucket), and each bucket's unpadded size. Megatron walks them in reverse."""
    places, unpadded = [None] * len(numels), []
    bucket_start, start, count = 0, 0, 0

    def close(end: int) -> int:
        nonlocal bucket_start, count
        unpadded.append(end - bucket_start)
        bucket_start, count = -(-end // align) * align, 0
        return bucket_start

    for i in reversed(range(len(numels))):
        start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
        if shared[i] and count:
            start = close(start)
        places[i] = (len(unpadded), start - bucket_start)
        end, count = start + numels[i], count + 1
        start = close(end) if (bucket_size is not None and end - bucket_start >= bucket_size) or shared[i] \
            else end
    if count:
        close(end)
    return places, unpadded


def _bucket_size(args: dict, pp_rank: int, chunk: int, rank_numel: int) -> int | None:
    """Megatron-LM's get_model / DistributedDataParallel: one bucket without --overlap-grad-reduce,
    on pipeline stages after the first and on model chunks after the first."""
    if not args.get("overlap_grad_reduce") or pp_rank > 0 or chunk > 0:
        return None
    if args.get("ddp_num_buckets"):
        return rank_numel // args["ddp_num_buckets"]
    return args.get("ddp_bucket_size") or default_bucket_size(_dp(args))


def _dp(args: dict) -> int:
    return args["data_parallel_size"] * (args.get("context_parallel_size") or 1)


class DpReshardable:
    """A torch_dist checkpoint's dp_reshardable optimizer state: where every saved parameter's
    state lies (checked against the stored buckets), its Adam step, and reads into megafab Shards.
    `view`: the checkpoint's megafab view (megatron_keys.megafab_view); `args`: its flat args."""

    def __init__(self, path: str, stored: dict, view: dict, args: dict, model_cfg, swiglu: bool):
        self.path = path
        self.buckets, self.prefix = {}, ""  # (optimizer, G, I, B) -> the key without the kind
        self.sizes, self.kinds, self.edges, self.dtypes = {}, set(), {}, {}
        for key, md in stored.items():
            match = BUCKET_KEY.match(key)
            if match:
                bucket = key[:-len(match[5]) - 1]
                self.buckets[tuple(int(g or 0) for g in match.groups()[:4])] = bucket
                self.sizes[bucket], self.dtypes[bucket] = tuple(md.size), md.properties.dtype
                self.kinds.add(match[5])
                self.prefix = "chained_0." if match[1] is not None else ""
                # where the saved pieces (a parameter's, or its part on one DP rank; padding) start and end
                self.edges[bucket] = {x for c in md.chunks for x in (c.offsets[0], c.offsets[0] + c.sizes[0])}
        names = {k[len(MODEL_PREFIX):]: tuple(md.size) for k, md in view.items()
                 if k.startswith(MODEL_PREFIX)}
        self.placed: dict[str, list[Placed]] = {}
        self._lay_out(names, args, model_cfg, swiglu)
        scaler = self.prefix + SCALER_OBJECT
        keys = [self.prefix + OPTIMIZER_OBJECT] + ([scaler] if scaler in stored else [])
        self.optimizer_object, *rest = _load_objects(path, keys)
        self.grad_scaler = rest[0] if rest else None

    @property
    def step(self) -> float | None:
        obj = self.optimizer_object
        groups = obj.get("param_groups") if isinstance(obj, dict) else None
        steps = [g["step"] for g in groups or [] if isinstance(g, dict) and "step" in g]
        return float(steps[0]) if steps else None

    def _lay_out(self, names: dict, args: dict, model_cfg, swiglu: bool) -> None:
        """Every saved rank's buffers: the dense ones (optimizer 0) per (tp, pp) rank, and with
        expert parallelism the expert-parallel ones (optimizer 1) per (expert-TP, EP, pp) rank."""
        tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
        ep = args.get("expert_model_parallel_size") or 1
        etp = args.get("expert_tensor_parallel_size") or tp
        split = PipelineSplit(model_cfg.num_layers, pp, args.get("virtual_pipeline_model_parallel_size") or 1,
                              args.get("decoder_first_pipeline_num_layers"),
                              args.get("decoder_last_pipeline_num_layers"),
                              bool(args.get("account_for_embedding_in_pipeline_split")),
                              bool(args.get("account_for_loss_in_pipeline_split")))
        total = getattr(getattr(model_cfg, "moe", None), "num_experts", None) or args.get("num_experts") or 0
        impl = args.get("transformer_impl") or "local"
        tied = not args.get("untie_embeddings_and_output_weights")
        grids = [(0, "all" if ep == 1 else "dense", tp, 1, _dp(args))]  # (optimizer, part, TP, EP, DP)
        if ep > 1:
            grids.append((1, "experts", etp, ep, _dp(args) * tp // (etp * ep)))
        for pp_rank in range(pp):
            for optimizer, part, grid_tp, grid_ep, dp in grids:
                chunks = [chunk_names(names, split, pp_rank, c, impl, total // grid_ep, tied, part)
                          for c in range(split.vpp)]
                for rank in range(grid_tp * grid_ep):  # rank in megatron-core's tp(-ep)-pp group order
                    experts = ExpertPlacement(total, rank // grid_tp * (total // grid_ep), grid_tp,
                                              rank % grid_tp, swiglu) if total else None
                    layouts = [[_layout(n, names[experts_name(n)], grid_tp, rank % grid_tp, swiglu, experts)
                                for n, *_ in c] for c in chunks]
                    numel = sum(lay.block_numel for c in layouts for lay in c)
                    gbuf = 0
                    for chunk, (named, lays) in enumerate(zip(chunks, layouts)):
                        if named:  # a chunk without expert parameters has no expert buffer
                            self._place((optimizer, rank + grid_tp * grid_ep * pp_rank, gbuf), named, lays,
                                        _bucket_size(args, pp_rank, chunk, numel), _align(dp, args))
                            gbuf += 1

    def _place(self, buffer: tuple, named: list, layouts: list, bucket_size, align: int) -> None:
        """Lay out one buffer (optimizer, dp_group_idx, gbuf_idx) and check it against the stored."""
        places, unpadded = bucket_starts([lay.block_numel for lay in layouts], [s for _, s, _ in named],
                                         bucket_size, align)
        stored = [self.sizes[key][0] for (*b, _), key in sorted(self.buckets.items()) if tuple(b) == buffer]
        if stored != unpadded:
            raise CheckpointError(
                f"megafab lays out the {SHARDING} buckets of (optimizer, dp_group_idx, gbuf_idx) {buffer} "
                f"as {unpadded} elements, but the checkpoint stores {stored}: the saving run's layout is "
                f"not the one its args describe")
        for (name, _, copy), lay, (b, start) in zip(named, layouts, places):
            bucket = self.buckets[(*buffer, b)]
            if not {start, start + lay.block_numel} <= self.edges[bucket]:
                raise CheckpointError(f"its parameter {name!r} does not fall on the stored pieces of "
                                      f"{bucket!r} where megafab lays it out")
            if not lay.replica and not copy:
                self.placed.setdefault(lay.name, []).append(Placed(lay, bucket, start))

    def optimizer_view(self, view: dict) -> dict:
        """The megafab optimizer keys the buckets hold (optim.<name>.<kind>, stored shapes)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        kinds = [MAIN_PARAM if k == "param" else k for k in sorted(self.kinds)]
        out, dtype = {}, next(iter(self.dtypes.values()))
        for name in self.placed:
            md = view[MODEL_PREFIX + name]
            props = type(md.properties)(dtype=dtype)
            out.update({optim_key(name, kind): TensorStorageMetadata(props, md.size, []) for kind in kinds})
        return out

    def plan(self, shards: dict[str, Shard]) -> tuple[dict[str, Shard], list]:
        """(bucket Shards to read: the rows of each saved block a requested box needs, (target, read)
        pairs to copy after the read) for megafab optimizer Shards."""
        loads, copies = {}, []
        for key, shard in shards.items():
            name, kind = split_key(key)
            for box, view in zip(shard.boxes, shard.views):
                for placed in self.placed.get(name, ()):
                    key = f"{placed.bucket}.{BUCKET_KIND.get(kind, kind)}"
                    copies += self._rows(placed, key, box, view, loads)
        return loads, copies

    def _rows(self, placed: Placed, key: str, box: Box, view: torch.Tensor, loads: dict) -> list:
        lay = placed.layout
        lo = [max(b, o) for b, o in zip(box.offsets, lay.block_offsets)]
        hi = [min(b + n, o + m)
              for b, n, o, m in zip(box.offsets, box.sizes, lay.block_offsets, lay.block_shape)]
        if any(h <= low for low, h in zip(lo, hi)):
            return []
        first, last = lo[0] - lay.block_offsets[0], hi[0] - lay.block_offsets[0]
        row = math.prod(lay.block_shape[1:])
        read = torch.empty((last - first) * row, dtype=self.dtypes[placed.bucket])
        loads.setdefault(key, Shard(self.sizes[placed.bucket])).add(
            Box((placed.start + first * row,), (read.numel(),)), read)
        inner = tuple(slice(a - o, b - o) for a, b, o in zip(lo[1:], hi[1:], lay.block_offsets[1:]))
        target = view[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, box.offsets))]
        return [(target, read.view(last - first, *lay.block_shape[1:])[(slice(None), *inner)])]


def _load_objects(path: str, keys: list[str]) -> list:
    """The saved optimizer's ShardedObjects `keys` (each stored as a one-element list), in one read."""
    # deferred: torch.distributed.checkpoint costs seconds to import; only saves and loads pay it
    from megafab.checkpoint import dcp_io

    raw = dcp_io.read_objects(path, keys)
    out = []
    for key in keys:
        if key not in raw:
            raise CheckpointError(f"its {SHARDING} optimizer state has no {key!r} object: the copy is "
                                  f"partial, copy the whole directory")
        obj = safe_pickle.loads(raw[key], f"{path} ({key})")
        out.append(obj[0] if isinstance(obj, list) and obj else obj)
    return out


def _align(dp: int, args: dict) -> int:
    """_pad_end_of_bucket_if_needed's divisor for a buffer sharded over `dp` ranks."""
    return math.lcm(dp, BUCKET_ALIGN, *((HIGH_BUSBW_ALIGN,) if args.get("ddp_pad_buckets_for_high_nccl_busbw")
                                        else ()))
