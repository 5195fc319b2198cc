"""Multi-token prediction (DeepSeek-V3; megatron-core 0.16.1's MultiTokenPredictionBlock): D layers
after the decoder of the last pipeline stage (its last virtual chunk), `mtp.layers.<k-1>` for depth k.

Depth k embeds the input ids shifted k left (megatron-core's roll_tensor: zeros enter at the end;
the position ids are rolled alike), normalizes that (enorm) and the previous depth's output (hnorm;
at depth 1 the decoder's output after its final norm), projects [embedding, hidden] 2h -> h
(eh_proj, column-parallel, then gathered; scattered back to sequence shards under SP), runs one
transformer layer of the decoder's last layer's kind and a final norm. Its logits come from the
model's output layer, its loss from the labels and loss mask rolled k left, masked-mean per depth.
The losses, times mtp_loss_scaling_factor / D, enter backward attached to the decoder's normed
output with the weight the schedule sets (megatron-core's MTPLossAutoScaler: grad scale / micro-
batches), so the returned loss, and the logged lm loss, stay the main loss; each depth's loss is
kept for the log (`mtp_<k> loss`, MTPLossLoggingHelper's names).
"""

from __future__ import annotations

import torch
from torch import nn

from megafab.distributed.context_parallel import context_parallel_masked_mean
from megafab.distributed.layers import ColumnParallelLinear
from megafab.distributed.mappings import (
    gather_first_dim,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    scatter_to_sequence_parallel_region,
)
from megafab.model.init import normal_init
from megafab.model.moe.balancing import LossScale, attach_loss
from megafab.model.recompute import recompute
from megafab.model.te import fp8_recompute_context
from megafab.model.te_wrap import TEWrappedTransformerLayer
from megafab.model.transformer import LayerContext, TransformerLayer, build_norm
from megafab.param_names import MTP_LAYERS, MTP_TRANSFORMER_LAYER, layer_prefix


def roll_left(tensor: torch.Tensor, cp_group=None) -> torch.Tensor:
    """[b, s] shifted one position left along the whole sequence, a zero entering at its end
    (megatron-core's roll_tensor). Under context parallelism a rank holds global chunks r and
    2cp-1-r (split_for_context_parallel): each chunk's new last token is the next chunk's first,
    gathered from the CP group (two tokens per rank and sequence)."""
    cp = group_size(cp_group)
    if cp == 1:
        rolled = torch.roll(tensor, shifts=-1, dims=-1)
        rolled[..., -1] = 0
        return rolled
    r = group_rank(cp_group)
    first, second = tensor.chunk(2, dim=-1)
    heads = torch.stack([first[..., 0], second[..., 0]])  # [2, b]: the first tokens of both chunks
    everyone = gather_first_dim(heads[None], cp_group)  # [cp, 2, b]
    after_first = everyone[r + 1][0] if r + 1 < cp else everyone[cp - 1][1]  # global chunk r + 1
    after_second = everyone[r - 1][1] if r > 0 else torch.zeros_like(heads[1])  # chunk 2cp - r
    return torch.cat([first[..., 1:], after_first[..., None], second[..., 1:], after_second[..., None]],
                     dim=-1)


class MTPLayer(nn.Module):
    """One depth: enorm, hnorm, eh_proj, transformer_layer, final_layernorm (megatron-core's names)."""

    def __init__(self, cfg, ctx: LayerContext, depth: int):
        super().__init__()
        prefix = layer_prefix(depth, MTP_LAYERS)
        self.ctx = ctx
        self.enorm = build_norm(cfg, ctx)
        self.hnorm = build_norm(cfg, ctx)
        self.eh_proj = ColumnParallelLinear(
            2 * cfg.hidden_size, cfg.hidden_size, tp_group=ctx.tp_group, bias=False,
            sequence_parallel=ctx.sequence_parallel, params_dtype=ctx.params_dtype, device=ctx.device,
            gradient_accumulation_fusion=ctx.gradient_accumulation_fusion,
            init_method=normal_init(ctx.seed, prefix + "eh_proj.weight", cfg.init_method_std))
        # megatron-core builds the decoder's last layer spec here (gpt_layer_specs.get_gpt_mtp_block_spec)
        te = cfg.transformer_impl == "transformer_engine"
        layer_class = TEWrappedTransformerLayer if te else TransformerLayer  # TE: around TE's modules
        self.transformer_layer = layer_class(cfg, ctx, cfg.num_layers - 1,
                                             prefix=prefix + MTP_TRANSFORMER_LAYER)
        self.final_layernorm = build_norm(cfg, ctx)
        # megatron-core checkpoints the whole depth under uniform full recompute (not under block)
        self.recompute = cfg.recompute_granularity == "full" and cfg.recompute_method == "uniform"

    def forward(self, hidden, embedded, rotary_angles=None, attention_mask=None):
        """hidden, embedded: [s(/tp), b, h] -> this depth's output [s(/tp), b, h]."""
        if self.recompute and self.training:
            with fp8_recompute_context(self.ctx):  # FP8: TE's checkpoint, as megatron-core's MTP layer
                return recompute(self._forward, hidden, embedded, rotary_angles, attention_mask,
                                 tracker=self.ctx.rng_tracker, device=self.ctx.device)
        return self._forward(hidden, embedded, rotary_angles, attention_mask)

    def _forward(self, hidden, embedded, rotary_angles, attention_mask):
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x, _ = self.eh_proj(x)  # [s, b, h/tp]
        x = gather_from_tensor_model_parallel_region(x, self.ctx.tp_group)  # [s, b, h]
        if self.ctx.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.ctx.tp_group)  # [s/tp, b, h]
        x = self.transformer_layer(x, rotary_angles, attention_mask)
        return self.final_layernorm(x)


class MTPBlock(nn.Module):
    """The container `mtp` (its `layers` are the model's parts) with the backward weight of the
    attached losses and this step's per-depth losses for the log."""

    def __init__(self, num_layers: int, scaling_factor: float, per_token: bool = False):
        """per_token (--calculate-per-token-loss): each depth's loss enters backward as its masked
        sum, as the main loss does (megatron-core: mtp_loss_scale * mtp_loss, not / num_tokens)."""
        super().__init__()
        self.layers = nn.ModuleDict()
        self.num_layers, self.scaling_factor, self.per_token = num_layers, scaling_factor, per_token
        self.loss_scale = LossScale()  # the schedule sets it (training/step.py)
        self.logged_losses: torch.Tensor | None = None  # [D]: sums over this step's micro-batches

    def forward(self, model, hidden, input_ids, position_ids, labels, loss_mask, angles=None,
                attention_mask=None) -> torch.Tensor:
        """`hidden` (the decoder's normed output) with the D depths' scaled losses attached;
        `model` gives the shared embedding, output layer and loss."""
        if loss_mask is None:
            loss_mask = torch.ones_like(labels)
        cp_group = model.ctx.cp_group
        total, logged, x = None, [], hidden
        for layer in self.layers.values():
            input_ids, position_ids = roll_left(input_ids, cp_group), roll_left(position_ids, cp_group)
            labels, loss_mask = roll_left(labels, cp_group), roll_left(loss_mask, cp_group)
            x = layer(x, model.embedding(input_ids, position_ids), angles, attention_mask)
            per_token = model.per_token_loss(model.logits(x), labels)  # [b, s]
            mask = loss_mask.to(per_token.dtype)
            loss = context_parallel_masked_mean(per_token, mask, cp_group)  # the whole sequence's mean
            logged.append(loss.detach())
            if self.per_token:  # this rank's tokens' sum, as the main loss
                loss = (per_token * mask).sum()
            scaled = loss * (self.scaling_factor / self.num_layers)
            total = scaled if total is None else total + scaled
        if self.training:
            values = torch.stack(logged).double()
            self.logged_losses = values if self.logged_losses is None else self.logged_losses + values
        return attach_loss(hidden, total, self.loss_scale)

    def take_logged_losses(self) -> torch.Tensor | None:
        """This step's per-depth loss sums (over micro-batches); the log starts over."""
        values, self.logged_losses = self.logged_losses, None
        return values


def mtp_problems(m, p) -> list[str]:
    """What multi-token prediction (model section `m`, parallel section `p`) cannot be combined with."""
    if m.mtp_num_layers is None:
        return []
    out = []
    if m.mtp_num_layers < 1:
        out.append(f"--mtp-num-layers {m.mtp_num_layers} must be at least 1 (omit the flag for no MTP)")
    if m.position_embedding_type == "learned_absolute" and p.pipeline_model_parallel_size > 1:
        out.append("--mtp-num-layers with learned absolute positions and --pipeline-model-parallel-size > 1: "
                   "megatron-core keeps a second position table on the last stage that is never "
                   "synchronized with the first stage's; use --position-embedding-type rope or PP 1")
    if m.recompute_granularity == "full" and m.recompute_method == "uniform" and m.recompute_num_layers != 1:
        out.append(f"--mtp-num-layers with --recompute-method uniform --recompute-num-layers "
                   f"{m.recompute_num_layers}: megatron-core recomputes each MTP layer whole and requires "
                   f"--recompute-num-layers 1 with uniform recompute")
    return out
