"""Shared experts: a dense MLP every token passes through beside the routed experts
(moe_shared_expert_intermediate_size wide), its output optionally scaled by a learned per-token
sigmoid gate. Tensor-parallel over the attention TP group like the dense MLP (megatron-core's
SharedExpertMLP): input [s(/tp), b, h] -> [s(/tp), b, h].
"""

from __future__ import annotations

import torch
from torch import nn

from megafab.distributed.layers import ColumnParallelLinear, RowParallelLinear
from megafab.model.init import normal_init
from megafab.model.moe.experts import ExpertShape


class SharedExpertMLP(nn.Module):
    def __init__(self, shape: ExpertShape, *, gate: bool, seed: int, prefix: str, ctx):
        super().__init__()
        self.shape = shape
        common = dict(tp_group=ctx.tp_group, bias=False, sequence_parallel=ctx.sequence_parallel,
                      params_dtype=ctx.params_dtype, device=ctx.device,
                      gradient_accumulation_fusion=ctx.gradient_accumulation_fusion)
        self.linear_fc1 = ColumnParallelLinear(
            shape.hidden_size, shape.fc1_out, stride=2 if shape.gated else 1,
            init_method=normal_init(seed, prefix + "linear_fc1.weight", shape.fc1_std), **common)
        self.linear_fc2 = RowParallelLinear(
            shape.ffn_hidden_size, shape.hidden_size, input_is_parallel=True,
            init_method=normal_init(seed, prefix + "linear_fc2.weight", shape.fc2_std), **common)
        if gate:
            weight = torch.empty(1, shape.hidden_size, dtype=torch.float64)
            normal_init(seed, prefix + "gate_weight", shape.fc1_std)(weight)
            self.gate_weight = nn.Parameter(weight.to(device=ctx.device, dtype=ctx.params_dtype))
            self.gate_weight.sequence_parallel = ctx.sequence_parallel
        else:
            self.gate_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.linear_fc1(x)
        out, _ = self.linear_fc2(self.shape.act(h))
        if self.gate_weight is not None:
            out = out * torch.sigmoid(torch.nn.functional.linear(x, self.gate_weight))
        return out
