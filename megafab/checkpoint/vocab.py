"""Loading a checkpoint into a model whose vocabulary is padded to another size.

Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by x TP, so a new TP size
often changes the padded size: dim 0 of the word embedding and of an untied output layer. Rows
[0, vocab_size) are the real tokens (the checkpoint's args record vocab_size) and are read from the
checkpoint, model and optimizer state alike. This model's padding rows start as initialization
sets them (megafab.model.init: normal(0, init_method_std) from the (seed, name) stream of the full
padded tensor, built in float32 -- float64 for float64 models -- and cast, as the layers build
their weights), their fp32 main params as those weights, their optimizer moments at zero. The
real vocabulary itself must match the checkpoint's.
"""

from __future__ import annotations

import torch

from megafab.checkpoint.boxes import Box
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import MAIN_PARAM, STEP, VOCAB_PADDED, Shard, split_key
from megafab.model.init import normal_init


class _InitRows:
    """The initial values of a vocab-padded parameter's full tensor, built once per name on demand
    (one full weight of host memory, as building the layer took)."""

    def __init__(self, seed: int, std: float, model_dtype: torch.dtype):
        self.seed, self.std, self.model_dtype = seed, std, model_dtype
        self.full: dict[str, torch.Tensor] = {}

    def values(self, name: str, global_shape: tuple[int, ...], box: Box) -> torch.Tensor:
        if name not in self.full:
            master = torch.float64 if self.model_dtype == torch.float64 else torch.float32
            full = torch.empty(global_shape, dtype=master)
            normal_init(self.seed, name, self.std)(full)
            self.full[name] = full.to(self.model_dtype)
        return self.full[name][tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]


def _split_rows(box: Box, rows: int) -> tuple[int, Box | None]:
    """How many of the box's rows are below `rows`, and the box of the rest (None when none)."""
    real = max(0, min(box.offsets[0] + box.sizes[0], rows) - box.offsets[0])
    if real == box.sizes[0]:
        return real, None
    return real, Box((box.offsets[0] + real, *box.offsets[1:]), (box.sizes[0] - real, *box.sizes[1:]))


def adapt_padded_vocab(shards: dict[str, Shard], stored: dict, saved_vocab_size: int | None,
                       model_cfg, seed: int, model_dtype: torch.dtype) -> str | None:
    """Where the checkpoint's padded vocabulary differs from this model's: request only the real
    rows of those keys and fill this rank's padding rows now (see the module docstring). Returns
    the note to print, or None when every padded size matches."""
    init = _InitRows(seed, model_cfg.init_method_std, model_dtype)
    vocab = model_cfg.vocab_size
    changed = None
    for key, shard in list(shards.items()):
        name, kind = split_key(key)
        md = stored.get(key)
        if name not in VOCAB_PADDED or kind == STEP or md is None:
            continue
        saved_shape = tuple(md.size)
        if saved_shape == shard.global_shape or saved_shape[1:] != shard.global_shape[1:]:
            continue  # same padding, or a different model: check_shards explains
        if saved_vocab_size != vocab or vocab > saved_shape[0]:
            raise CheckpointError(
                f"checkpoint tensor {key!r} has {saved_shape[0]} rows for a vocabulary of "
                f"{saved_vocab_size} tokens, but this model's vocabulary has {vocab} tokens; a "
                f"different padding is resharded, a different vocabulary is not: use the "
                f"checkpoint's tokenizer (or --vocab-size {saved_vocab_size})")
        real_rows = Shard(saved_shape)
        for box, view in zip(shard.boxes, shard.views):
            real, padding = _split_rows(box, vocab)
            if real:
                real_rows.add(Box(box.offsets, (real, *box.sizes[1:])), view[:real])
            if padding is not None:
                rest = view[real:]
                if kind in (None, MAIN_PARAM):  # the weight, its fp32 main copy
                    rest.copy_(init.values(name, shard.global_shape, padding))
                else:  # an optimizer moment
                    rest.zero_()
        shards[key] = real_rows
        changed = (saved_shape[0], shard.global_shape[0])
    if changed is None:
        return None
    return (f"the checkpoint's vocabulary of {vocab} tokens is padded to {changed[0]} rows, this "
            f"model's to {changed[1]}: the {vocab} real rows are loaded, the padding rows start as "
            f"initialization sets them, with zero optimizer state")
