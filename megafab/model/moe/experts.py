"""The routed experts of one rank: an MLP each, applied to its rows, outputs weighted by the rows'
routing probabilities (applied after the activation, before fc2, as megatron-core does).

    SequentialExperts  local_experts.{i}.linear_fc1.weight [f(*2), h], .linear_fc2.weight [h, f]:
                       one GEMM pair per local expert (megatron-core's SequentialMLP names)
    GroupedExperts     linear_fc1.weight [E_local, f(*2), h], linear_fc2.weight [E_local, h, f]:
                       torch's grouped matmul where it runs (grouped_mm_runs), else the same loop
                       of GEMMs; the same numbers either way

Each expert's weights are drawn from (seed, "<prefix>experts.<global index>.linear_fcN.weight"),
so both classes hold the same weights and an EP rank holds exactly its experts' weights. Expert
tensor parallelism splits every expert as the dense MLP splits over TP (ExpertSplit); the linears
do no communication. Every routed-expert parameter is marked `is_expert` (its gradient is reduced
over expert-DP, not DP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megafab.distributed.layers import ParallelLayerError, partition_of
from megafab.distributed.mappings import group_rank, group_size
from megafab.model.activations import MLPActivation
from megafab.model.init import normal_init, output_layer_std
from megafab.model.recompute import DiscardedOutput
from megafab.param_names import COLUMN_DIM, ROW_DIM, SWIGLU_STRIDE

GROUPED_MM = getattr(F, "grouped_mm", None)


class ExpertShape:
    """What every expert of a layer shares: widths, activation (model/activations.py), bias, init."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: MLPActivation,
                 bias: bool, init_method_std: float, num_layers: int):
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.act, self.bias = activation, bias
        self.gated = activation.gated  # fc1 packed [gate; linear], twice as wide
        self.fc1_out = ffn_hidden_size * (2 if self.gated else 1)
        self.fc1_std = init_method_std
        self.fc2_std = output_layer_std(init_method_std, num_layers)

    def activate(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """fc1's output (its bias added) -> the activation weighted by each row's routing probability."""
        h = self.act(h)
        return (h * probs.unsqueeze(-1)).to(h.dtype)


class ExpertSplit:
    """How one ETP rank holds an expert: its rank and size in etp_group (None: ETP 1).

    fc1 is column-parallel (SwiGLU's packed [gate; up] strided, each rank [gate_r; up_r]), fc2
    row-parallel; rank r keeps exactly its partition of the one-process weight (partition_of). At
    ETP > 1 the split params carry the dense layers' attributes (tensor_model_parallel,
    partition_dim, partition_stride: dims of the local layout, so the grouped weights' are one
    higher: _mark_split), read as "split over etp_group". At ETP 1 they carry none (megatron-core
    sets them at any size): readers that know only the attention TP group (checkpoint layout,
    grad-norm) then see expert params as TP-replicated, which they are at ETP 1. The dispatcher
    hands every ETP rank the rows of all of them and sums their partial fc2 outputs. Expert biases
    under ETP > 1 are refused by megatron-core's config (and megafab's checks) but still taken
    here: output_bias."""

    def __init__(self, shape: ExpertShape, etp_group, params_dtype: torch.dtype):
        self.shape = shape
        self.master_dtype = torch.float64 if params_dtype == torch.float64 else torch.float32
        self.rank, self.size = group_rank(etp_group), group_size(etp_group)
        if shape.ffn_hidden_size % self.size != 0:
            raise ParallelLayerError(
                f"the expert FFN hidden size is {shape.ffn_hidden_size}, which is not divisible by the "
                f"expert-tensor-parallel size {self.size}; choose a multiple of {self.size}")
        self.fc1_stride = SWIGLU_STRIDE if shape.gated else 1

    def weights(self, seed: int, name: str, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's partitions of the expert `name`'s full fc1 [fc1_out, h] (column) and fc2
        [h, f] (row) weights, drawn from (seed, name + "linear_fcN.weight")."""
        shape = self.shape
        fc1 = self._partition((shape.fc1_out, shape.hidden_size), COLUMN_DIM, self.fc1_stride, seed,
                              name + "linear_fc1.weight", shape.fc1_std)
        fc2 = self._partition((shape.hidden_size, shape.ffn_hidden_size), ROW_DIM, 1, seed,
                              name + "linear_fc2.weight", shape.fc2_std)
        return fc1.to(device=device, dtype=dtype), fc2.to(device=device, dtype=dtype)

    def _partition(self, full_shape, dim: int, stride: int, seed: int, name: str, std: float) -> torch.Tensor:
        master = torch.empty(full_shape, dtype=self.master_dtype)
        normal_init(seed, name, std)(master)
        return partition_of(master, dim, self.rank, self.size, stride)

    def output_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """The fc2 bias this rank adds: all of it on ETP rank 0, a zero with its gradient elsewhere
        (the combine's reduce-scatter sums the ranks' outputs; every rank sees every row's grad)."""
        return bias if self.rank == 0 else bias - bias.detach()


def _mark_split(split: ExpertSplit, param: nn.Parameter | None, dim: int, stride: int = 1) -> None:
    if param is not None and split.size > 1:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, stride


def _mark_expert(module: nn.Module) -> None:
    for p in module.parameters():
        p.is_expert = True


class SequentialExperts(nn.Module):
    def __init__(self, shape: ExpertShape, num_local_experts: int, first_expert: int, *, seed: int,
                 prefix: str, params_dtype: torch.dtype, device=None, etp_group=None):
        super().__init__()
        self.shape = shape
        split = ExpertSplit(shape, etp_group, params_dtype)
        self.local_experts = nn.ModuleList(
            _ExpertMLP(shape, split, f"{prefix}experts.{first_expert + i}.", seed, params_dtype, device)
            for i in range(num_local_experts))
        _mark_expert(self)

    def forward(self, rows: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor) -> torch.Tensor:
        """rows [M, h] grouped by local expert (tokens_per_expert[i] rows each) -> [M, h]."""
        outputs = [expert(x, p) for expert, x, p in zip(self.local_experts, rows.split(tokens_per_expert),
                                                        probs.split(tokens_per_expert))]
        return torch.cat(outputs, dim=0)


class _ExpertMLP(nn.Module):
    def __init__(self, shape: ExpertShape, split: ExpertSplit, name: str, seed: int, dtype, device):
        super().__init__()
        self.shape, self.split = shape, split
        fc1, fc2 = split.weights(seed, name, dtype, device)
        self.linear_fc1 = _Linear(fc1, shape.bias)  # [fc1_out/etp, h]
        self.linear_fc2 = _Linear(fc2, shape.bias)  # [h, f/etp]
        for p in (self.linear_fc1.weight, self.linear_fc1.bias):
            _mark_split(split, p, COLUMN_DIM, split.fc1_stride)
        _mark_split(split, self.linear_fc2.weight, ROW_DIM)

    def forward(self, x, probs):
        h = self.linear_fc1(x, add_bias=False)
        if self.linear_fc1.bias is not None:  # after the GEMM, as megatron-core's (bf16 rounds alike)
            h = h + self.linear_fc1.bias
        out = self.linear_fc2(self.shape.activate(h, probs), add_bias=False)
        if self.linear_fc2.bias is not None:  # the output bias is weighted like the output, added in
            # the probabilities' dtype (an fp32 router's) and rounded to the output's, as megatron-core
            out = (out + self.split.output_bias(self.linear_fc2.bias) * probs.unsqueeze(-1)).to(out.dtype)
        return out


class _Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)) \
            if bias else None

    def forward(self, x, add_bias: bool = True):
        return F.linear(x, self.weight, self.bias if add_bias else None)


class GroupedExperts(nn.Module):
    def __init__(self, shape: ExpertShape, num_local_experts: int, first_expert: int, *, seed: int,
                 prefix: str, params_dtype: torch.dtype, device=None, etp_group=None,
                 recompute_activation: bool = False):
        """recompute_activation: --recompute-modules moe_act, the activation's output (fc2's input)
        freed after fc2 and recomputed from fc1's output in backward (recompute.DiscardedOutput)."""
        super().__init__()
        self.shape = shape
        self.recompute_activation = recompute_activation
        self.split = split = ExpertSplit(shape, etp_group, params_dtype)
        fc1, fc2 = zip(*(split.weights(seed, f"{prefix}experts.{e}.", params_dtype, device)
                         for e in range(first_expert, first_expert + num_local_experts)))
        self.linear_fc1 = _GroupedLinear(torch.stack(fc1), shape.bias)  # [E_local, fc1_out/etp, h]
        self.linear_fc2 = _GroupedLinear(torch.stack(fc2), shape.bias)  # [E_local, h, f/etp]
        for p in (self.linear_fc1.weight, self.linear_fc1.bias):  # one dim after the expert dim
            _mark_split(split, p, COLUMN_DIM + 1, split.fc1_stride)
        _mark_split(split, self.linear_fc2.weight, ROW_DIM + 1)
        _mark_expert(self)

    def forward(self, rows: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor) -> torch.Tensor:
        activation = DiscardedOutput(self.shape.activate, active=self.recompute_activation and self.training)
        h = activation(self.linear_fc1(rows, tokens_per_expert), probs)
        out = self.linear_fc2(h, tokens_per_expert, add_bias=False)
        activation.discard(out)
        if self.linear_fc2.bias is not None:  # per expert, as megatron-core's TEGroupedMLP._apply_bias:
            bias = self.split.output_bias(self.linear_fc2.bias)  # its gradient summed in probs' dtype
            out = torch.cat([rows_e + b * p.unsqueeze(-1) for rows_e, b, p in zip(
                out.split(tokens_per_expert), bias, probs.split(tokens_per_expert))]).to(out.dtype)
        return out


class _GroupedLinear(nn.Module):
    """E_local linears [E_local, out, in] applied to consecutive row blocks."""

    def __init__(self, weight: torch.Tensor, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(torch.zeros(weight.shape[:2], dtype=weight.dtype, device=weight.device)) \
            if bias else None

    def bias_rows(self, tokens_per_expert: list[int], bias: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's expert bias ([E_local, out] `bias`, default this linear's) -> [M, out]."""
        bias = self.bias if bias is None else bias
        counts = torch.tensor(tokens_per_expert, device=bias.device)
        return bias.repeat_interleave(counts, dim=0, output_size=sum(tokens_per_expert))

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int], add_bias: bool = True) -> torch.Tensor:
        if grouped_mm_runs(x, self.weight):
            offsets = torch.tensor(tokens_per_expert, device=x.device).cumsum(0).to(torch.int32)
            out = GROUPED_MM(x, self.weight.transpose(-2, -1), offs=offsets)
        else:
            out = torch.cat([F.linear(rows, w) for rows, w in zip(x.split(tokens_per_expert), self.weight)])
        return out + self.bias_rows(tokens_per_expert) if add_bias and self.bias is not None else out


def grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands (its kernels: CPU float32/bf16, CUDA
    bf16; every row 16-byte aligned)."""
    if GROUPED_MM is None or x.dtype != weight.dtype:
        return False
    kernels = {"cuda": (torch.bfloat16,), "cpu": (torch.float32, torch.bfloat16)}
    dtypes = kernels.get(x.device.type, ())
    aligned = all(n * x.element_size() % 16 == 0 for n in weight.shape[1:])
    return x.dtype in dtypes and aligned
