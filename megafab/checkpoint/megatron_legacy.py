"""Megatron-LM's legacy `torch` checkpoint format: one file per tensor- and pipeline-parallel rank.

    iter_0000100/
        mp_rank_00/model_optim_rng.pt          PP 1: mp_rank_<TP rank:02d>/
        mp_rank_00_000/model_optim_rng.pt      PP > 1: mp_rank_<TP rank:02d>_<PP rank:03d>/
        mp_rank_00_000_001/model_optim_rng.pt  expert-parallel: _<EP rank:03d> appended (PP 1 too)
        mp_rank_00_000/distrib_optim.pt        the distributed optimizer's flat buffers

Each model_optim_rng.pt is a torch.save'd dict (write_rank_file): args, checkpoint_version 3.0,
iteration, the model chunks (this rank's TP shards, layers numbered from 0 within the stage),
optimizer, scheduler and RNG state. LegacySource reads any TP/PP/EP layout into any other; the
optimizer state is refused (--no-load-optim / --finetune load the rest). megafab writes the
format with --ckpt-format torch, without optimizer state (save_rank_file).
"""

from __future__ import annotations

import os

import torch

from megafab.checkpoint import safe_pickle
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import MODEL_PREFIX, Shard, split_key, strided_dim, strided_shape, to_stored
from megafab.checkpoint.megatron_args import flat_from_args, unknown_model
from megafab.checkpoint.megatron_dist import MEGAFAB, MEGATRON_RNG, SCHEDULER_FIELDS
from megafab.checkpoint.megatron_keys import LINEAR_MODULES
from megafab.checkpoint.source import CheckpointSource, Counters, counters_from_common
from megafab.config import Config
from megafab.distributed.layers import join_partitions, partition_of
from megafab.model.activations import gated_linear_unit
from megafab.model.fp8_params import dequantized, is_fp8_param
from megafab.param_names import (
    EXPERT_BIAS,
    EXTRA_STATE,
    OUTPUT_LAYER,
    WORD_EMBEDDING,
    chunk_key,
    chunk_keys,
    is_first_rank_dir,
    is_routed_expert,
    layer_name,
    layer_of,
    local_to_te_name,
    parse_rank_dir,
    rank_dir,
    rank_dir_ranks,
    sequential_expert,
    sequential_expert_name,
    te_to_local_name,
    to_global,
    to_stage,
    tp_partition,
)
from megafab.pipeline_split import PipelineSplit

FILE = "model_optim_rng.pt"
DIST_OPTIM_FILE = "distrib_optim.pt"
OPTIMIZER_PROBLEM = ("the legacy torch format keeps the optimizer state in Megatron's parameter order and "
                     "flat buffers of the saving job's layout, which megafab does not reshard")


def _first_file(path: str) -> str | None:
    """The file of TP rank 0, PP rank 0, EP rank 0 (whichever of PP/EP the names carry)."""
    firsts = sorted(n for n in os.listdir(path) if is_first_rank_dir(n))
    return os.path.join(path, firsts[0], FILE) if firsts else None


def _rank_files(path: str, pp: int, ep: int) -> dict[tuple[int, int, int], str]:
    files = {}
    for name in sorted(os.listdir(path)):
        ranks = rank_dir_ranks(name, pp, ep)
        if ranks is not None:
            files[ranks] = os.path.join(path, name, FILE)
    return files


def _model_keys(state: dict, file: str) -> list[str]:
    keys = chunk_keys(state)
    if not keys:
        raise CheckpointError(f"{file} holds no model state ('model' or 'model0' ...); it was saved without "
                              f"the model: load a checkpoint that has it")
    return keys


class LegacySource(CheckpointSource):
    """A legacy checkpoint directory (see the module docstring); model_cfg None: the model its
    args record.

    Read with safe_pickle, memory-mapped, so a rank pages in only the tensors it copies: each
    parameter is joined from the TP files that hold it (param_names.tp_partition) one at a time and
    its boxes copied out, so any layout loads any other. The optimizer state follows Megatron's
    parameter order and buffers and is refused."""

    def __init__(self, path: str, model_cfg=None, release: bool = False):
        first_file = _first_file(path)
        if first_file is None or not os.path.isfile(first_file):
            raise CheckpointError(f"{path} has no {rank_dir(0, 0, 1)}[_000]/{FILE}: the legacy checkpoint is "
                                  f"incomplete; copy the whole iteration directory")
        first = safe_pickle.load(first_file, mmap=True)
        args = flat_from_args(first.get("args"))
        names = [parse_rank_dir(n) for n in os.listdir(path) if parse_rank_dir(n) is not None]
        self.ep = args.get("expert_model_parallel_size") or (2 if any(e for _, _, e in names) else 1)
        self.pp = args.get("pipeline_model_parallel_size") or 1 + max(p for _, p, _ in names)
        files = _rank_files(path, self.pp, self.ep)
        if self.ep > 1 and not args.get("expert_model_parallel_size"):
            self.ep = 1 + max(e for _, _, e in files)
        self.tp = args.get("tensor_model_parallel_size") or 1 + max(t for t, _, _ in files)
        self.num_experts = args.get("num_experts")
        etp = args.get("expert_tensor_parallel_size")
        if self.num_experts and etp not in (None, self.tp):
            raise CheckpointError(f"{path} is a legacy checkpoint saved with --expert-tensor-parallel-size "
                                  f"{etp} under TP {self.tp}; megafab reads legacy expert files at ETP = TP "
                                  f"only: convert it with Megatron to torch_dist")
        everyone = [(t, p, e) for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)]
        missing = [rank_dir(t, p, self.pp, e, self.ep) for t, p, e in everyone
                   if not os.path.isfile(files.get((t, p, e), ""))]
        if missing:
            raise CheckpointError(f"{path} is a legacy checkpoint saved at TP {self.tp} x PP {self.pp}"
                                  f"{f' x EP {self.ep}' if self.ep > 1 else ''} but "
                                  f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (/{FILE}) "
                                  f"are missing; copy the whole iteration directory")
        if model_cfg is None:
            if not args.get("num_layers"):
                raise unknown_model(path)
            model_cfg = Config.from_flat(args).model
        self.model_cfg, self.files, self._cache = model_cfg, files, {(0, 0, 0): first}
        self.vpp = len(_model_keys(first, first_file))
        saved = args.get  # the saving run's layers per stage (uneven first/last stages too)
        self.split = PipelineSplit(
            model_cfg.num_layers, self.pp, self.vpp, saved("decoder_first_pipeline_num_layers"),
            saved("decoder_last_pipeline_num_layers"), bool(saved("account_for_embedding_in_pipeline_split")),
            bool(saved("account_for_loss_in_pipeline_split")))
        self.index = self._index(path)
        stored = {}
        for name, pieces in self.index.items():
            stored[MODEL_PREFIX + name] = _metadata(self._stored_shape(name, pieces), pieces[0][-1].dtype)
        has_optimizer = "optimizer" in first or os.path.exists(os.path.join(os.path.dirname(first_file),
                                                                            DIST_OPTIM_FILE))
        ours = first.get(MEGAFAB)  # megafab-written: its counters and per-rank RNG files
        rng_layout = ours["layout"] if ours and ours["has_rng"] else None
        super().__init__("torch", path, stored, args or None, args.get("vocab_size"),
                         None if release else _counters(first, args), has_optimizer, OPTIMIZER_PROBLEM,
                         rng_layout, None if ours else MEGATRON_RNG)

    def _file(self, ranks: tuple[int, int, int]) -> dict:
        if ranks not in self._cache:
            self._cache[ranks] = safe_pickle.load(self.files[ranks], mmap=True)
        return self._cache[ranks]

    def _index(self, path: str) -> dict[str, list]:
        """megafab (local-spec) name -> [(tp_rank, global expert or None, tensor)] in TP order, every
        stage's (and EP rank's) file read; routed experts under their stacked (grouped) name.

        An EP rank's file holds the dense weights (each EP rank's copy) and its own experts as
        SequentialMLP names them, local_experts.<i> = global expert EP rank x E/EP + i.
        Grouped-GEMM experts (GroupedMLP's weight1/weight2, TEGroupedMLP's weight<i>) are refused
        by name; expert-TP must equal TP."""
        index: dict[str, list] = {}
        tied = not self.model_cfg.untie_embeddings_and_output_weights
        local_experts = (self.num_experts or 0) // self.ep
        for (t, p, e) in sorted(self.files, key=lambda r: (r[1], r[2], r[0])):
            state = self._file((t, p, e))
            for chunk, key in enumerate(_model_keys(state, self.files[(t, p, e)])):
                first_layer, _ = self.split.layer_range(p, chunk)
                for local_name, tensor in state[key].items():
                    name = te_to_local_name(local_name)
                    if name is None or not torch.is_tensor(tensor) or (tied and name == OUTPUT_LAYER):
                        continue  # _extra_state; the last stage's copy of a tied embedding
                    name = to_global(name, first_layer)
                    sequential = sequential_expert(name)
                    if sequential is not None:
                        expert = e * local_experts + sequential[0]
                        index.setdefault(sequential[1], []).append((t, expert, tensor))
                    elif is_routed_expert(name):
                        raise CheckpointError(f"{self.files[(t, p, e)]}: {local_name!r} is a grouped-GEMM "
                                              f"expert weight (GroupedMLP / TEGroupedMLP); megafab reads "
                                              f"legacy MoE files of SequentialMLP experts: convert it with "
                                              f"Megatron to torch_dist (its expert keys suit every layout)")
                    elif e == 0:  # the dense weights: every EP rank keeps a copy
                        index.setdefault(name, []).append((t, None, tensor))
        return index

    def _split(self, name: str):
        """TP split of `name`'s pieces: a routed expert's as its sequential name (one expert) has it."""
        piece_name = sequential_expert_name(name, 0) if is_routed_expert(name) else name
        return tp_partition(piece_name, gated_linear_unit(self.model_cfg))

    def _stored_shape(self, name: str, pieces) -> tuple[int, ...]:
        shape = list(pieces[0][-1].shape)
        split = self._split(name)
        if split is not None:
            shape[split[0]] *= self.tp
        if is_routed_expert(name):
            shape = [len({g for _, g, _ in pieces}), *shape]
        dim = strided_dim(name, gated_linear_unit(self.model_cfg))
        return tuple(shape) if dim is None else strided_shape(tuple(shape), dim, 2)

    def full_tensor(self, name: str) -> torch.Tensor:
        """The TP=1 tensor of megafab parameter `name` (local-spec name), joined from the TP files;
        routed experts stacked on the global expert axis."""
        pieces = self.index[name]
        split = self._split(name)

        def joined(parts):
            return parts[0] if split is None else join_partitions(parts, *split)
        if not is_routed_expert(name):
            return joined([tensor for _, _, tensor in pieces])
        experts = sorted({g for _, g, _ in pieces})
        return torch.stack([joined([tensor for _, g, tensor in pieces if g == e]) for e in experts])

    def read(self, shards: dict[str, Shard]) -> None:
        for key, shard in shards.items():
            name, kind = split_key(key)
            assert kind is None, key  # the optimizer state is refused (OPTIMIZER_PROBLEM)
            local = te_to_local_name(name) or name
            if not shard.boxes:
                continue
            stored = to_stored(local, self.full_tensor(local), self.model_cfg)
            for box, view in zip(shard.boxes, shard.views):
                view.copy_(stored[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))])


def _metadata(shape, dtype):
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [])


def _counters(state: dict, args: dict) -> Counters | None:
    ours = state.get(MEGAFAB)
    if ours is not None:
        return counters_from_common(ours)
    sched = state.get("opt_param_scheduler")
    if sched is None or "iteration" not in state:
        return None
    scheduler = {SCHEDULER_FIELDS[k]: v for k, v in sched.items() if k in SCHEDULER_FIELDS}
    return Counters(int(state["iteration"]), int(args.get("consumed_train_samples", 0)),
                    int(args.get("consumed_valid_samples", 0)), scheduler=scheduler,
                    optimizer_iteration=int(state["iteration"]),
                    num_floating_point_operations_so_far=float(
                        state.get("num_floating_point_operations_so_far") or 0))


# ---- writing -------------------------------------------------------------------------------------
def _with_extra_states(out: dict) -> dict:
    """A None `_extra_state` per linear module of each layer, as megatron-core's local layers save:
    the dense MLP's or, in an MoE layer, each local expert's and the shared experts' linears."""
    modules = set()
    for name in out:
        layer = layer_of(name)
        module, _, leaf = name.rpartition(".")
        if layer is not None and leaf == "weight" and module.rpartition(".")[2].startswith("linear_"):
            modules.add(module)
    for layer in sorted({layer_of(n) for n in out} - {None}):
        if layer_name(layer, "self_attention.linear_kv_down_proj.weight") not in out:  # MLA: found above
            modules.update(layer_name(layer, m) for m in LINEAR_MODULES[:2])  # attention's, always
    for module in sorted(modules):
        out[f"{module}.{EXTRA_STATE}"] = None
    return out


def _as_sequential(name: str, tensor: torch.Tensor, first_expert: int = 0, count: int | None = None) -> dict:
    """A stacked routed-expert tensor (grouped names) as SequentialMLP's local_experts.<i> entries:
    experts [first_expert, first_expert + count) numbered from 0; other tensors as they are."""
    if not is_routed_expert(name) or sequential_expert(name) is not None:
        return {name: tensor}
    count = tensor.shape[0] - first_expert if count is None else count
    return {sequential_expert_name(name, i): tensor[first_expert + i] for i in range(count)}


def local_state_dict(chunk, first_layer: int, te_names: bool) -> dict:
    """A megafab model chunk's parameters as Megatron's legacy state dict (layers numbered from 0
    within the stage; a tied last stage's output_layer copy included, as Megatron keeps it; grouped
    experts as SequentialMLP's local experts; the routers' expert_bias buffers, as Megatron's
    state dict holds them)."""
    out = {}
    for name, p in chunk.named_parameters():
        values = dequantized(p) if is_fp8_param(p) else p.detach()  # TE's FP8 weights: model dtype
        for n, t in _as_sequential(to_stage(name, first_layer), values).items():
            out[local_to_te_name(n) if te_names else n] = t.cpu().clone()
    for name, b in chunk.named_buffers():
        if name.endswith("." + EXPERT_BIAS):
            out[to_stage(name, first_layer)] = b.detach().cpu().clone()
    return _with_extra_states(out)


def rank_state_dict(sd: dict, model_cfg, tp: int, tp_rank: int, pp: int, pp_rank: int, ep: int = 1,
                    ep_rank: int = 0) -> dict:
    """The legacy state dict of TP rank tp_rank, stage pp_rank, EP rank ep_rank (its E/EP experts
    as local_experts.<i>, expert-TP = TP), cut from a full megafab state dict."""
    first, last = PipelineSplit(model_cfg.num_layers, pp).layer_range(pp_rank, 0)
    tied = not model_cfg.untie_embeddings_and_output_weights
    stage = {}
    for name, full in sd.items():
        layer = layer_of(name)
        if layer is not None and not first <= layer < last:
            continue
        if layer is None and (name.startswith("embedding.") and pp_rank > 0
                          or not name.startswith("embedding.") and pp_rank < pp - 1):
            continue
        stage[name] = full
    if tied and pp > 1 and pp_rank == pp - 1:  # the last stage's copy of the tied embedding
        stage[OUTPUT_LAYER] = sd[WORD_EMBEDDING]
    out = {}
    for stacked, tensor in stage.items():
        local_experts = tensor.shape[0] // ep if is_routed_expert(stacked) else None
        first_expert = ep_rank * (local_experts or 0)
        for name, full in _as_sequential(stacked, tensor, first_expert, local_experts).items():
            split = tp_partition(name, gated_linear_unit(model_cfg))
            local = partition_of(full, split[0], tp_rank, tp, split[1]) if split else full
            out[to_stage(name, first)] = local.contiguous().clone()
    return _with_extra_states(out)


def write_rank_file(tmp: str, tp_rank: int, pp_rank: int, pp: int, common: dict, models: dict,
                    ep_rank: int = 0, ep: int = 1) -> None:
    """The one writer of a legacy model_optim_rng.pt: `common` (megatron_dist.megatron_common) and
    this rank's model chunks (chunk_key -> local state dict), without optimizer state.

    Megatron's file (megatron/training/checkpointing.py, generate_state_dict) holds args
    (argparse.Namespace), checkpoint_version (3.0), iteration, model (model0, model1, ... with
    virtual pipeline stages: GPTModel.state_dict_for_save_checkpoint(), `_extra_state` entries
    included), optimizer, opt_param_scheduler, rng_state, num_floating_point_operations_so_far and
    rerun_state_machine."""
    directory = os.path.join(tmp, rank_dir(tp_rank, pp_rank, pp, ep_rank, ep))
    os.makedirs(directory, exist_ok=True)
    torch.save({**common, **models}, os.path.join(directory, FILE))


def save_rank_file(state, tmp: str, common: dict) -> None:
    """This rank's model_optim_rng.pt of a training run, without optimizer state (config.py refuses
    --ckpt-format torch with it); DP rank 0 of each TP x PP position writes (with experts, expert-DP
    rank 0 of each TP x EP x PP position, named by its EP rank too)."""
    cfg, topo = state.cfg, state.topology
    moe = cfg.moe.num_experts is not None
    if (topo.coord("edp") if moe else topo.dp_rank) != 0:
        return
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    te = cfg.model.transformer_impl == "transformer_engine"
    split = PipelineSplit.from_config(cfg)
    models = {}
    for c, chunk in enumerate(state.model):
        first, _ = split.layer_range(topo.pp_rank, c)
        module = getattr(chunk, "module", chunk)
        models[chunk_key(c, vpp)] = local_state_dict(module, first, te)
    ep = topo.size("ep") if moe else 1
    write_rank_file(tmp, topo.tp_rank, topo.pp_rank, topo.pp, common, models,
                    topo.coord("ep") if moe else 0, ep)
