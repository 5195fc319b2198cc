"""The routed experts of one rank: an MLP each, applied to its rows, outputs weighted by the rows'
routing probabilities (applied after the activation, before fc2, as megatron-core does).

    SequentialExperts  local_experts.{i}.linear_fc1.weight [f(*2), h], .linear_fc2.weight [h, f]:
                       one GEMM pair per local expert (megatron-core's SequentialMLP names)
    GroupedExperts     linear_fc1.weight [E_local, f(*2), h], linear_fc2.weight [E_local, h, f]:
                       torch's grouped matmul where it runs (CPU fp32/bf16, CUDA bf16, 16-byte
                       aligned rows), else the same loop of GEMMs; the same numbers either way

Each expert's weights are drawn from (seed, "<prefix>experts.<global index>.linear_fcN.weight"),
so both classes hold the same weights and an EP rank holds exactly its experts' weights. Every
routed-expert parameter is marked `is_expert` (its gradient is reduced over expert-DP, not DP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megafab.model.init import normal_init, output_layer_std

GROUPED_MM = getattr(F, "grouped_mm", None)


class ExpertShape:
    """What every expert of a layer shares: widths, activation, bias, init."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, swiglu: bool, activation,
                 bias: bool, init_method_std: float, num_layers: int):
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.swiglu, self.activation, self.bias = swiglu, activation, bias
        self.fc1_out = ffn_hidden_size * (2 if swiglu else 1)
        self.fc1_std = init_method_std
        self.fc2_std = output_layer_std(init_method_std, num_layers)

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """fc1 output -> activation (SwiGLU: silu(gate) * up, fc1 packed [gate; up])."""
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return self.activation(h)

    def activate(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The activation weighted by each row's routing probability."""
        h = self.act(h)
        return (h * probs.unsqueeze(-1)).to(h.dtype)


def _expert_weight(shape, seed: int, name: str, std: float, dtype, device) -> torch.Tensor:
    master = torch.empty(shape, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    normal_init(seed, name, std)(master)
    return master.to(device=device, dtype=dtype)


def _mark_expert(module: nn.Module) -> None:
    for p in module.parameters():
        p.is_expert = True


class SequentialExperts(nn.Module):
    def __init__(self, shape: ExpertShape, num_local_experts: int, first_expert: int, *, seed: int,
                 prefix: str, params_dtype: torch.dtype, device=None):
        super().__init__()
        self.shape = shape
        self.local_experts = nn.ModuleList(
            _ExpertMLP(shape, f"{prefix}experts.{first_expert + i}.", seed, params_dtype, device)
            for i in range(num_local_experts))
        _mark_expert(self)

    def forward(self, rows: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor) -> torch.Tensor:
        """rows [M, h] grouped by local expert (tokens_per_expert[i] rows each) -> [M, h]."""
        outputs = [expert(x, p) for expert, x, p in zip(self.local_experts, rows.split(tokens_per_expert),
                                                        probs.split(tokens_per_expert))]
        return torch.cat(outputs, dim=0)


class _ExpertMLP(nn.Module):
    def __init__(self, shape: ExpertShape, name: str, seed: int, dtype, device):
        super().__init__()
        self.shape = shape
        self.linear_fc1 = _Linear(_expert_weight((shape.fc1_out, shape.hidden_size), seed,
                                                 name + "linear_fc1.weight", shape.fc1_std, dtype, device),
                                  shape.bias)
        self.linear_fc2 = _Linear(_expert_weight((shape.hidden_size, shape.ffn_hidden_size), seed,
                                                 name + "linear_fc2.weight", shape.fc2_std, dtype, device),
                                  shape.bias)

    def forward(self, x, probs):
        out = self.linear_fc2(self.shape.activate(self.linear_fc1(x), probs), add_bias=False)
        if self.linear_fc2.bias is not None:  # the output bias is weighted like the output
            out = out + self.linear_fc2.bias * probs.unsqueeze(-1)
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
                 prefix: str, params_dtype: torch.dtype, device=None):
        super().__init__()
        self.shape = shape
        experts = range(first_expert, first_expert + num_local_experts)

        def stacked(fc, rows, cols, std):
            return torch.stack([_expert_weight((rows, cols), seed, f"{prefix}experts.{e}.{fc}.weight", std,
                                               params_dtype, device) for e in experts])

        self.linear_fc1 = _GroupedLinear(
            stacked("linear_fc1", shape.fc1_out, shape.hidden_size, shape.fc1_std), shape.bias)
        self.linear_fc2 = _GroupedLinear(
            stacked("linear_fc2", shape.hidden_size, shape.ffn_hidden_size, shape.fc2_std), shape.bias)
        _mark_expert(self)

    def forward(self, rows: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor) -> torch.Tensor:
        h = self.shape.activate(self.linear_fc1(rows, tokens_per_expert), probs)
        out = self.linear_fc2(h, tokens_per_expert, add_bias=False)
        if self.linear_fc2.bias is not None:
            out = out + self.linear_fc2.bias_rows(tokens_per_expert) * probs.unsqueeze(-1)
        return out


class _GroupedLinear(nn.Module):
    """E_local linears [E_local, out, in] applied to consecutive row blocks."""

    def __init__(self, weight: torch.Tensor, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(torch.zeros(weight.shape[:2], dtype=weight.dtype, device=weight.device)) \
            if bias else None

    def bias_rows(self, tokens_per_expert: list[int]) -> torch.Tensor:
        counts = torch.tensor(tokens_per_expert, device=self.bias.device)
        return self.bias.repeat_interleave(counts, dim=0, output_size=sum(tokens_per_expert))

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
