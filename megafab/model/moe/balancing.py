"""Load balancing: the auxiliary losses, the z-loss, how their gradient enters backward, and the
aux-loss-free expert bias.

The losses are not added to the LM loss. Like megatron-core, each one is attached to an activation
of the router (`attach_loss`): forward passes the activation through unchanged, backward adds the
gradient `scale` for the loss, so d(total)/d(params) = d(lm loss) + scale * d(aux loss). The
training schedule sets `scale` the way Megatron's forward_step sets MoEAuxLossAutoScaler's:
loss_scale * cp / num_micro_batches (loss_scale with --calculate-per-token-loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megafab.distributed.mappings import group_size


class LossScale:
    """The backward weight of the attached losses, shared by every MoE layer of a model chunk."""

    def __init__(self, value: float | torch.Tensor = 1.0):
        self.value = value

    def set(self, value: float | torch.Tensor) -> None:
        self.value = value


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return activation

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss) * ctx.scale.value, None


def attach_loss(activation: torch.Tensor, loss: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """`activation` unchanged; backward through it also differentiates `loss` with weight scale."""
    return _AttachLoss.apply(activation, loss, scale)


def summed_over(tensor: torch.Tensor, group) -> torch.Tensor:
    """A copy of `tensor` summed over `group` (no autograd: token counts)."""
    if group_size(group) == 1:
        return tensor
    out = tensor.clone()
    dist.all_reduce(out, group=group)
    return out


def switch_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: int, topk: int,
                num_experts: int, coeff: float) -> torch.Tensor:
    """Switch Transformer's balancing loss E * sum_i f_i * P_i * coeff, where f_i is the fraction of
    the total_tokens * topk assignments that go to expert i (counted over the reduce group) and P_i
    the mean score of expert i. `scores` [N, E] are this rank's tokens only: the loss is this rank's
    share, and the shares of the group add up to the group's loss."""
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_tokens * total_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2, times coeff."""
    return torch.square(torch.logsumexp(logits, dim=-1)).mean() * coeff


@torch.no_grad()
def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float,
                        group) -> torch.Tensor:
    """Aux-loss-free balancing (DeepSeek-V3): after a step each expert's bias moves by `rate` toward
    balance, up where the expert got fewer tokens than the mean, down where more. Counts
    [layers, E] are summed over `group` first (Megatron: TP x CP x DP, all ranks of a stage)."""
    counts = summed_over(tokens_per_expert, group)
    offset = counts.sum(dim=-1, keepdim=True) / counts.shape[-1] - counts
    return expert_bias + torch.sign(offset) * rate


@torch.no_grad()
def update_expert_biases(routers, rate: float, group) -> None:
    """Megatron's end-of-step update of every router's expert bias from the tokens it routed since
    the last update (one all-reduce for all layers), then the counts restart at 0."""
    routers = [r for r in routers if r.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    biases = torch.stack([r.expert_bias for r in routers])
    for router, bias in zip(routers, updated_expert_bias(counts, biases, rate, group)):
        router.expert_bias.copy_(bias)
        router.local_tokens_per_expert.zero_()
