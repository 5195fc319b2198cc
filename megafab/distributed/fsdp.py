"""ZeRO-3 of one model chunk through torch FSDP2 (`fully_shard` over the data-parallel DeviceMesh).

    FullyShardedDataParallel(chunk, mesh=..., units=layer_units(chunk.decoder.layers.values()), ...)

Every parameter becomes a DTensor sharded on dim 0 over the DP x CP mesh (data_parallel_mesh): rank
r keeps rows [r * c, (r + 1) * c) of its TP block, c = ceil(rows / dp). Each unit is one FSDP2 group
(per transformer layer its attention block, its MLP and the layer itself: layer_units), the chunk
the root group holding the rest; FSDP2 all-gathers a group's parameters before its forward and
backward, frees them after, and reduce-scatters gradients averaged over DP. Routed experts are
groups of their own over expert-DP (expert_units). The chunk is built on the meta device and this
rank's shards are filled one part at a time (fill_shards); the values equal the non-sharded
build's. Same methods as DistributedDataParallel for the schedules, finalize_model_grads, the
optimizers and the checkpoint layout. torch.distributed.tensor costs seconds to import, so only
runs that shard import it (`local_tensor` tells a DTensor without importing it). TE's FP8 weights
(--fp8-param-gather) shard as FP8, gathered as uint8 through TE's FSDP2 hooks (cast_fp8_shards).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn

from megafab.distributed import data_parallel, param_gather
from megafab.distributed.data_parallel import is_expert_param
from megafab.model.fp8_params import INIT_VALUE, cast_masters, is_fp8_param

# Megatron's per-parameter attributes that the rest of megafab reads off the parameters (and an FP8
# weight's init value, which its main starts from).
PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                    "grad_sum_over_tp", "shared_embedding", "is_embedding_or_output_parameter",
                    "is_expert", "embedding_copy", INIT_VALUE)


def data_parallel_mesh(topology):
    """The 1-D DeviceMesh FSDP2 shards over (DP x CP), made from the group megafab already built
    (no new groups: gloo cannot split groups on CPU)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(topology.group("dp", "cp"), device_type=topology.device.type,
                                 mesh_dim_names=("dp",))


def expert_data_parallel_mesh(topology):
    """The 1-D DeviceMesh expert params shard over: expert-DP (CP folded in), from the group
    megafab already built."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(topology.group("edp"), device_type=topology.device.type,
                                 mesh_dim_names=("edp",))


def expert_units(module: nn.Module) -> list[nn.Module]:
    """The outermost submodules of `module` whose trainable parameters are all expert params (the
    routed experts of each MoE layer; inside a ModuleList, each member), in module order. An
    expert param outside them (one held by a module that also holds dense params) cannot be
    sharded over its own mesh: refused.

    Expert params are replicated only across expert-DP, so each unit is an FSDP2 group of its own
    over the expert-DP mesh (CP folded in, as megatron-core's expert grid), sharded before the
    layer that holds it so the layer's group leaves those parameters to it. FSDP2 averages its
    gradients over expert-DP; finish_grad_sync rescales them to the DP x CP average."""
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        params = [p for p in m.parameters() if p.requires_grad]
        container = isinstance(m, (nn.ModuleList, nn.ModuleDict))  # no forward of its own to hook
        if params and not container and all(is_expert_param(p) for p in params):
            units.append(m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    inside = {id(p) for unit in units for p in unit.parameters()}
    stray = [n for n, p in module.named_parameters()
             if is_expert_param(p) and id(p) not in inside]
    assert not stray, f"expert params held beside dense params cannot shard over expert-DP: {stray}"
    return units


SUB_BLOCKS = ("self_attention", "mlp")  # a transformer layer's children that are FSDP2 units


def layer_units(layers: Iterable[nn.Module]) -> list[nn.Module]:
    """The FSDP2 units of transformer layers, in the order they are sharded: per layer its
    attention block and its MLP (SUB_BLOCKS, where they run a forward of their own: not the
    Transformer Engine layer's plain containers), then the layer itself (what is left: its norms).
    A unit per sub-block rather than per layer keeps FSDP2's working set (a unit's gathered
    weights and unsharded gradient, the next unit's gather) to the MLP's two-thirds of a layer
    (measured: benchmarks/README.md, `memory.py --peaks`). The root's weights are gathered and its gradient
    unsharded through the whole backward (the tied output layer's backward comes first, the
    embedding's last)."""
    units: list[nn.Module] = []
    for layer in layers:
        for name in SUB_BLOCKS:
            block = getattr(layer, name, None)
            if block is not None and type(block).forward is not nn.Module.forward \
                    and any(p.requires_grad for p in block.parameters()):
                units.append(block)
        units.append(layer)
    return units


def is_dtensor(t) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of FSDP2's storage), or `t` itself."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def shard_range(param: torch.Tensor) -> tuple[int, int]:
    """The flat range [lo, hi) of the (TP-local) parameter that this rank's dim-0 shard covers."""
    if not is_dtensor(param):
        return 0, param.numel()
    local = local_tensor(param)
    rows = local.shape[0] if local.dim() else 1
    row = local.numel() // rows if rows else 0
    first = param.__create_chunk_list__()[0].offsets[0] if param.dim() else 0
    return first * row, first * row + local.numel()


def _mixed_precision(compute_dtype: torch.dtype, main_dtype: torch.dtype, reduce: torch.dtype | None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if reduce is None:
        reduce = torch.float64 if main_dtype == torch.float64 else torch.float32
    return MixedPrecisionPolicy(param_dtype=compute_dtype if compute_dtype != main_dtype else None,
                                reduce_dtype=reduce if reduce != compute_dtype else None)


def buffers_to_empty(module: nn.Module, device: torch.device) -> None:
    """Allocate the meta-device buffers of `module` on `device`, uninitialized (fill_shards fills
    them); what to_empty does, for a module whose parameters are already placed."""
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty_like(buffer, device=device)


@torch.no_grad()
def fill_shards(module: nn.Module, parts: Iterable[tuple[str, nn.Module]]) -> None:
    """Copy this rank's shard of every parameter (the whole parameter when it is not a DTensor,
    and every buffer whole) of `module` from `parts`: (name, initialized copy of submodule
    `name`), each dropped before the next is built, so no more than one part's unsharded tensors
    exist at a time.

    Megatron's --init-model-with-meta-device, always on here: the chunk is built on `meta` (no
    memory, no init), sharded, `to_empty` allocates only this rank's shards, and each part is built
    on the device with the same name-keyed init as a full build, so the values equal the
    non-sharded build's exactly."""
    targets = dict(module.named_parameters())
    targets.update(module.named_buffers())
    filled = set()
    for name, part in parts:
        filled.update(_copy_shards(targets, name, part))
        del part  # before the generator builds the next part
    missing = sorted(set(targets) - filled)
    assert not missing, f"no part initialized {missing}"


def _copy_shards(targets: dict[str, torch.Tensor], name: str, part: nn.Module) -> list[str]:
    keys = []
    for key, full in itertools.chain(part.named_parameters(), part.named_buffers()):
        key = f"{name}.{key}"
        target = targets[key]
        assert tuple(full.shape) == tuple(target.shape), (key, full.shape, target.shape)
        lo, hi = shard_range(target)
        local_tensor(target).view(-1).copy_(full.detach().reshape(-1)[lo:hi])
        keys.append(key)
    return keys


class FullyShardedDataParallel(nn.Module):
    """Wraps a model chunk the way DistributedDataParallel does (same methods for the schedules,
    finalize_model_grads and the optimizers) but shards it with FSDP2; see the module docstring.

    Arguments:
        module: the model chunk in the model dtype, built on the meta device (then `device` and
            `initialized_parts` fill this rank's shards, see fill_shards), or on the device (every
            rank the same full TP block: tests and small models).
        mesh: the DP DeviceMesh (data_parallel_mesh(topology)).
        units: submodules that each become one FSDP2 group (the transformer layers).
        expert_mesh: the expert-DP DeviceMesh (expert_data_parallel_mesh(topology)) the expert
            units shard over; None = `mesh` (right only at expert-parallel size 1).
        main_dtype: dtype the shards are stored in: fp32 masters for a bf16/fp16 model, the model
            dtype with optimizer offload (the host keeps the masters).
        reshard_after_forward: free each group's gathered parameters after its forward and gather
            them again in backward (ZeRO-3); False keeps them until backward (Megatron-FSDP's
            optim_grads, ZeRO-2's communication).
        reduce_dtype: dtype gradients are reduced and accumulated in; None = fp32 (fp64 for an
            fp64 model); the model dtype with --grad-reduce-in-bf16.
        device: where a meta-built chunk's shards live.
        initialized_parts: for a meta-built chunk, yields (submodule name, that submodule built
            and initialized on the device) one at a time, together covering every parameter and
            buffer (GPTModel.initialized_parts).

    Mixed precision as Megatron computes: the shards are kept in `main_dtype` (the fp32 master
    weights the optimizer steps), all-gathered in the model dtype, gradients reduced and
    accumulated in fp32. Inside `no_sync()` FSDP2 does not reduce and accumulates each unsharded
    gradient; the last micro-batch's backward reduce-scatters the sum. There is no grad buffer and
    no `param.main_grad`: the TP linear core returns a weight's gradient through autograd. The
    Megatron attributes of every parameter (tensor_model_parallel, partition_dim,
    sequence_parallel, shared_embedding, ...) are carried over to its DTensor, so
    finalize_model_grads, the norm and the checkpoint layout treat it as the parameter it shards.
    On CUDA FSDP2 overlaps its collectives with compute on separate streams, which needs
    CUDA_DEVICE_MAX_CONNECTIONS > 1 (the TP core's warning asks for 1, which serializes them).
    """

    is_fully_sharded = True

    def __init__(self, module: nn.Module, *, mesh, units: list[nn.Module], expert_mesh=None,
                 main_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
                 reduce_dtype: torch.dtype | None = None, device: torch.device | None = None,
                 initialized_parts: Callable[[], Iterable[tuple[str, nn.Module]]] | None = None):
        from torch.distributed.fsdp import fully_shard

        super().__init__()
        params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in params}
        assert len(dtypes) == 1, f"FSDP2 wraps a chunk of one parameter dtype, got {dtypes}"
        self.compute_dtype = dtypes.pop()
        self.main_dtype = main_dtype or self.compute_dtype
        self.mesh = mesh
        self.dp_group = mesh.get_group()
        self.dp = mesh.size()
        self.expert_mesh = mesh if expert_mesh is None else expert_mesh
        self.expert_dp_group = self.expert_mesh.get_group()
        attributes = {name: {a: getattr(p, a) for a in PARAM_ATTRIBUTES if hasattr(p, a)}
                      for name, p in module.named_parameters()}
        on_meta = any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))
        assert not on_meta or (initialized_parts is not None and device is not None), \
            "a chunk built on the meta device needs its device and initialized_parts"
        with torch.no_grad():
            for p in params:  # free on the meta device; a whole-model copy otherwise
                if not is_fp8_param(p):  # TE's FP8 weights shard as they are (TE's FSDP2 hooks)
                    p.data = p.data.to(self.main_dtype)
                elif not hasattr(p, "fsdp_pre_all_gather"):
                    raise data_parallel.DataParallelConfigError(
                        "--fp8-param-gather with FSDP2 needs Transformer Engine >= 2.10 (its FP8 "
                        "weights' FSDP2 all-gather hooks); upgrade transformer_engine, or use "
                        "--use-distributed-optimizer instead of FSDP2")
        policy = _mixed_precision(self.compute_dtype, self.main_dtype, reduce_dtype)
        # A sub-layer unit (layer_units) returns a view (a linear's 3-D output); FSDP2 warns that an
        # in-place op on it would skip its pre-backward hook. The layers add those outputs out of
        # place (residual + out), so the warning is about nothing here.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        experts = expert_units(module)
        for unit in experts:  # before the layers: theirs are the params left over
            fully_shard(unit, mesh=self.expert_mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward)
        units = [u for u in units if all(u is not e for e in experts)]
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        if torch.distributed.get_backend(self.dp_group) == "gloo":
            all_gather, reduce_scatter = _gloo_comms()
            for unit in [*units, module]:
                unit.set_custom_all_gather(all_gather)
                unit.set_custom_reduce_scatter(reduce_scatter)
        if on_meta:
            module.to_empty(device=device)  # this rank's shards (and the buffers), uninitialized
            fill_shards(module, initialized_parts())
        for name, p in module.named_parameters():
            for attr, value in attributes[name].items():
                setattr(p, attr, value)
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.expert_params = [p for p in self.params if is_expert_param(p)]
        self.expert_grad_scale = self.expert_mesh.size() / self.dp  # FSDP2's average -> DP x CP's
        self._fp8_pending: dict[nn.Parameter, torch.Tensor] | None = None  # a load's, to cast
        self.fp8_params = [p for p in self.params if is_fp8_param(local_tensor(p))]  # cast every step

    # ---- what each rank holds ---------------------------------------------------------------------
    def owned_param_ranges(self) -> dict[nn.Parameter, tuple[int, int]]:
        """Per parameter, the flat range [lo, hi) of its TP block this rank's shard holds (absent
        when this rank holds none of it: more DP ranks than rows)."""
        ranges = {p: shard_range(p) for p in self.params}
        return {p: r for p, r in ranges.items() if r[1] > r[0]}

    # ---- the DistributedDataParallel surface --------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches run inside only accumulate (unsharded, fp32); the last one reduces."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    @torch.no_grad()
    def finish_grad_sync(self):
        """FSDP2 waits for its reduce-scatters at the end of backward; what is left is the expert
        shards' scaling from FSDP2's average over expert-DP to the average over DP x CP: x
        expert-DP / (DP x CP), as megatron-core's expert gradient scaling (data_parallel.py). Not
        FSDP2's set_gradient_divide_factor: it divides twice on a 1-rank mesh in torch 2.13."""
        if self.expert_grad_scale != 1.0:
            for p in self.expert_params:
                if p.grad is not None:
                    local_tensor(p.grad).mul_(self.expert_grad_scale)

    def zero_grad_buffer(self):
        self.module.zero_grad(set_to_none=True)

    # ---- TE's FP8 weights (--fp8-param-gather) ------------------------------------------------------
    def cast_fp8_shards(self, owned_values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Cast `owned_values[p]` (the new values of p's flat local shard) into the FP8 local shards
        with TE's cast_master_weights_to_fp8, every FP8 weight listed on every rank (the amax
        reduction over DP is collective; None where a rank holds no rows). FSDP2 gathers the uint8
        shards at the next forward through TE's FSDP2 hooks, which also make TE's transposes."""
        params = self.fp8_params
        if params:
            cast_masters([local_tensor(p) for p in params], [owned_values.get(p) for p in params],
                         [0 if p in owned_values else None for p in params], self.dp_group,
                         manual_post_processing=False)

    def load_fp8_shards(self, owned_values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Values read into the FP8 weights' shards: cast by apply_fp8_loads once read."""
        self._fp8_pending = {**(self._fp8_pending or {}), **owned_values}

    def apply_fp8_loads(self) -> None:
        if self._fp8_pending is not None:  # on every rank, owning any of the weights or not
            self.cast_fp8_shards(self._fp8_pending)
            self._fp8_pending = None

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)


def _gloo_comms():
    """FSDP2's unit all-gather and reduce-scatter for gloo: gloo gathers into a flat copy of the
    whole output and copies a reduce-scatter's whole input, one more unit each on top of FSDP2's
    own buffers; a unit of more than GLOO_SLICE elements per rank goes in slices instead
    (param_gather.all_gather_in_slices, data_parallel.reduce_scatter_bucket), smaller ones as
    FSDP2 sends them."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class Allocate:
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

    class SlicedAllGather(Allocate, AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if not param_gather.sliced_on_gloo(input_tensor.numel(), group):
                return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
            param_gather.all_gather_in_slices(output_tensor, dist.get_world_size(group), dist.get_rank(group),
                                              group)
            return None

    class SlicedReduceScatter(Allocate, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if not param_gather.sliced_on_gloo(output_tensor.numel(), group):
                return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op,
                                                  async_op=async_op)
            data_parallel.reduce_scatter_bucket(output_tensor, input_tensor, op, group, async_op=False)
            return None

    return SlicedAllGather(), SlicedReduceScatter()


def is_fully_sharded(chunk) -> bool:
    return getattr(chunk, "is_fully_sharded", False)


def compute_dtype(chunk: nn.Module) -> torch.dtype:
    """The dtype a model chunk computes in (an FSDP2 chunk may store fp32 masters of a bf16 model)."""
    return chunk.compute_dtype if is_fully_sharded(chunk) else next(chunk.parameters()).dtype
