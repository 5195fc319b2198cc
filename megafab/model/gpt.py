"""GPTModel for one pipeline stage or virtual chunk: a range of layers, the embedding on the
first chunk (pre_process), final norm + output layer + loss on the last (post_process).

Names follow megatron-core (`embedding.word_embeddings.weight`, `decoder.layers.3.mlp.linear_fc1
.weight`, `decoder.final_layernorm.weight`, `output_layer.weight`); layer numbers are global, so a
state dict key means the same tensor in every pipeline layout.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megafab import param_names as keys
from megafab.distributed.context_parallel import local_position_ids
from megafab.distributed.cross_entropy import vocab_parallel_cross_entropy
from megafab.distributed.layers import VocabParallelEmbedding
from megafab.distributed.linear import linear_with_grad_accumulation_and_async_allreduce
from megafab.distributed.mappings import group_size, scatter_to_sequence_parallel_region
from megafab.model.init import normal_init
from megafab.model.mtp import MTPBlock, MTPLayer
from megafab.model.recompute import RecomputeSettings, forward_layers
from megafab.model.rotary import RotaryEmbedding, rope_kind
from megafab.model.te import fp8_chunk_context
from megafab.model.te_wrap import transformer_layer_class
from megafab.model.transformer import LayerContext, build_norm
from megafab.param_names import OUTPUT_LAYER, WORD_EMBEDDING
from megafab.pipeline_split import PipelineSplit


class Embedding(nn.Module):
    def __init__(self, cfg, ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        self.dropout = cfg.hidden_dropout
        learned = cfg.position_embedding_type == "learned_absolute"
        # Without learned positions the SP scatter folds into the embedding's reduction (Megatron).
        self.reduce_scatter = ctx.sequence_parallel and not learned and group_size(ctx.tp_group) > 1
        self.word_embeddings = VocabParallelEmbedding(
            cfg.padded_vocab_size, cfg.hidden_size, tp_group=ctx.tp_group, params_dtype=ctx.params_dtype,
            device=ctx.device, init_method=normal_init(ctx.seed, WORD_EMBEDDING, cfg.init_method_std),
            reduce_scatter_embeddings=self.reduce_scatter)
        self.position_embeddings = None
        if learned:
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                                    device=ctx.device, dtype=ctx.params_dtype)
            normal_init(ctx.seed, "embedding.position_embeddings.weight",
                        cfg.init_method_std)(self.position_embeddings.weight)

    def forward(self, input_ids, position_ids):
        if self.reduce_scatter:
            x = self.word_embeddings(input_ids)  # [s/tp, b, h]
        else:
            x = self.word_embeddings(input_ids)  # [b, s, h]
            if self.position_embeddings is not None:
                x = x + self.position_embeddings(position_ids)
            x = x.transpose(0, 1).contiguous()  # [s, b, h]
            if self.ctx.sequence_parallel:
                x = scatter_to_sequence_parallel_region(x, self.ctx.tp_group)  # [s/tp, b, h], a copy
        if self.training and self.dropout > 0:
            with self.ctx.residual_rng():
                x = F.dropout(x, self.dropout, training=True)
        return x


class GPTModel(nn.Module):
    """Layers [first_layer, last_layer) of a GPT; see the module docstring."""

    def __init__(self, cfg, ctx: LayerContext, first_layer: int = 0, last_layer: int | None = None,
                 pre_process: bool = True, post_process: bool = True):
        super().__init__()
        last_layer = cfg.num_layers if last_layer is None else last_layer
        self.cfg, self.ctx = cfg, ctx
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings = not cfg.untie_embeddings_and_output_weights
        self.input_tensor = None
        self.first_layer, self.last_layer = first_layer, last_layer
        self.recompute = RecomputeSettings.from_model_config(cfg)
        self.rotary = None
        # multi-token prediction: the last chunk of the last stage (megatron-core without a custom layout)
        self.mtp_depths = (cfg.mtp_num_layers or 0) if post_process else 0
        for name in self.part_names():
            if name.startswith("decoder.") and not hasattr(self, "decoder"):
                self._add_decoder()
            if name.startswith(keys.MTP_LAYERS) and not hasattr(self, "mtp"):
                self.mtp = MTPBlock(self.mtp_depths, cfg.mtp_loss_scaling_factor,
                                    ctx.calculate_per_token_loss)
            parent, _, attr = name.rpartition(".")
            setattr(self.get_submodule(parent), attr, self.build_part(name, ctx))
        if not hasattr(self, "decoder"):
            self._add_decoder()
        if getattr(cfg, "compile_layers", False):
            for layer in self.decoder.layers.values():
                layer.compile()  # in place: parameter names (and checkpoints) stay unchanged
        for p in self.shared_embedding_params():
            p.shared_embedding = True
        if hasattr(self, "embedding") and not pre_process:  # MTP's copy of the first stage's embedding
            self.embedding.word_embeddings.weight.embedding_copy = True
        for p in self.embedding_or_output_params():
            p.is_embedding_or_output_parameter = True  # their own LR with --decoupled-lr

    def _add_decoder(self) -> None:
        """The container of the layers (registered after the embedding: parameter order matters)."""
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleDict()

    def part_names(self) -> list[str]:
        """The submodules that together hold every parameter and buffer, in build order; each is
        built (and initialized) by build_part on its own."""
        names = ["embedding"] if self.pre_process or self.mtp_depths else []
        names += ["rotary"] if rope_kind(self.cfg) is not None else []
        names += [keys.layer_module(i) for i in range(self.first_layer, self.last_layer)]
        if self.post_process:
            names.append("decoder.final_layernorm")
            names += [keys.mtp_layer_module(i) for i in range(self.mtp_depths)]
            if not (self.share_embeddings and "embedding" in names):
                names.append("output_layer")
        return names

    def build_part(self, name: str, ctx: LayerContext) -> nn.Module:
        """Part `name` (of part_names()) built and initialized in `ctx` (its device and seed)."""
        cfg = self.cfg
        if name == "embedding":
            return Embedding(cfg, ctx)
        if name == "rotary":
            return RotaryEmbedding.from_model_config(cfg, ctx.device)
        layer = keys.module_layer(name)
        if layer is not None:  # local TransformerLayer or Transformer Engine's
            return transformer_layer_class(cfg, moe=ctx.moe is not None)(cfg, ctx, layer)
        if name == "decoder.final_layernorm":
            return build_norm(cfg, ctx)
        if keys.module_mtp_layer(name) is not None:
            return MTPLayer(cfg, ctx, keys.module_mtp_layer(name))
        assert name == "output_layer", name
        # Untied, or the last stage's copy of a tied embedding (same name-seed: starts equal).
        init_name = WORD_EMBEDDING if self.share_embeddings else OUTPUT_LAYER
        return VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, tp_group=ctx.tp_group,
                                      params_dtype=ctx.params_dtype, device=ctx.device,
                                      init_method=normal_init(ctx.seed, init_name, cfg.init_method_std))

    def initialized_parts(self):
        """(name, part) for every part, each built and initialized on the chunk's device, one at a
        time (a part is dropped before the next is built once the caller lets it go): how FSDP2
        fills the shards of a chunk built on the meta device with the values of a full build."""
        for name in self.part_names():
            yield name, self.build_part(name, self.ctx)

    def embedding_or_output_params(self) -> list[nn.Parameter]:
        """Megatron's is_embedding_or_output_parameter: word embedding (first stage), output layer
        weight (last stage; the tied copy there too, and MTP's copy of the embedding)."""
        out = [self.embedding.word_embeddings.weight] if hasattr(self, "embedding") else []
        if self.post_process and hasattr(self, "output_layer"):
            out.append(self.output_layer.weight)
        return out

    def shared_embedding_params(self) -> list[nn.Parameter]:
        """The word-embedding weights this chunk holds that another stage holds too (first and/or
        last stage): tied, or (untied too) with multi-token prediction, whose last stage embeds
        (megatron-core's _get_shared_word_embedding_weight)."""
        if not (self.share_embeddings or self.cfg.mtp_num_layers):
            return []
        out = [self.embedding.word_embeddings.weight] if hasattr(self, "embedding") else []
        if self.share_embeddings and self.post_process and hasattr(self, "output_layer"):
            out.append(self.output_layer.weight)
        return out

    def output_weight(self) -> torch.Tensor:
        if self.share_embeddings and hasattr(self, "embedding"):
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] -> [s, b, V/tp] through the output layer."""
        sp = self.ctx.sequence_parallel
        return linear_with_grad_accumulation_and_async_allreduce(
            x, self.output_weight(), None, group=self.ctx.tp_group,
            gradient_accumulation_fusion=self.ctx.gradient_accumulation_fusion,
            allreduce_dgrad=group_size(self.ctx.tp_group) > 1 and not sp, sequence_parallel=sp)

    def per_token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross entropy of logits [s, b, V/tp] against labels [b, s] -> [b, s]."""
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.ctx.tp_group,  # [s, b]
                                            fused=self.cfg.cross_entropy_loss_fusion)
        return loss.t()

    def set_input_tensor(self, tensor) -> None:
        """The pipeline schedule hands a non-first chunk its input here (Megatron's contract)."""
        self.input_tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor

    def forward(self, input_ids=None, position_ids=None, labels=None, attention_mask=None, kv_cache=None,
                loss_mask=None):
        """First chunk: ids [b, s]; later chunks: the tensor from set_input_tensor [s(/tp), b, h].

        kv_cache (generation, megafab.inference.KVCache): `kv_cache.layer(n)` keeps global layer n's
        keys/values; pass position_ids and an attention_mask [b|1, 1, s, cached + s] with it.

        Last chunk returns per-token loss [b, s] when labels are given, else logits [s, b, V/tp].
        With multi-token prediction and labels, its losses (loss_mask [b, s]: default all ones) are
        attached to the backward of that loss (model/mtp.py).
        Other chunks return hidden states [s(/tp), b, h] for the next stage.
        """
        if position_ids is None and input_ids is not None:
            position_ids = local_position_ids(input_ids.shape[1], self.ctx.cp_group,
                                              input_ids.device).expand_as(input_ids)
        x = self.embedding(input_ids, position_ids) if self.pre_process else self.input_tensor
        angles = self.rotary(position_ids, self.ctx.params_dtype) if self.rotary is not None else None
        if kv_cache is None:
            with fp8_chunk_context(self.ctx):  # one FP8 region per chunk, as megatron-core's block
                x = forward_layers(self.decoder.layers.values(), x, self.recompute, self.ctx, angles,
                                   attention_mask)
        else:
            for number, layer in self.decoder.layers.items():
                x = layer(x, angles, attention_mask, kv_cache=kv_cache.layer(int(number)))
        if not self.post_process:
            return x
        x = self.decoder.final_layernorm(x)  # [s(/tp), b, h]
        if self.mtp_depths and labels is not None and kv_cache is None:
            x = self.mtp(self, x, input_ids, position_ids, labels, loss_mask, angles, attention_mask)
        logits = self.logits(x)  # [s, b, V/tp]
        if labels is None:
            return logits
        # A new tensor, not a view: FSDP2 hooks its backward on the output of the chunk.
        return self.per_token_loss(logits, labels).clone()  # [b, s]


def build_model_chunks(cfg, ctx: LayerContext, pp: int = 1, pp_rank: int = 0, vpp: int = 1,
                       split: PipelineSplit | None = None, on_meta: bool = False) -> list[GPTModel]:
    """This pipeline rank's model chunks (one without interleaving). `split` places the layers
    (uneven first/last stages, embedding/loss counted as layers); default: an even split.

    on_meta: build every parameter and buffer on the meta device (no memory, no init); the chunks
    still compute on ctx.device once filled (GPTModel.initialized_parts gives their values)."""
    split = split or PipelineSplit(cfg.num_layers, pp, vpp)
    assert (split.pp, split.vpp) == (pp, vpp), "the split was made for another pipeline layout"
    build_ctx = dataclasses.replace(ctx, device=torch.device("meta")) if on_meta else ctx
    chunks = []
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        for c in range(vpp):
            first, last = split.layer_range(pp_rank, c)
            chunks.append(GPTModel(cfg, build_ctx, first, last, pre_process=(pp_rank == 0 and c == 0),
                                   post_process=(pp_rank == pp - 1 and c == vpp - 1)))
    build_ctx.device = ctx.device  # the layers share this context: they compute on the real device
    return chunks


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's micro-batch loss: sum(loss * mask) / sum(mask)."""
    mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / mask.sum()
