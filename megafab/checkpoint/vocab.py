"""The padding rows of the vocabulary: one rule (Megatron's) for conversion and for loading into a
model whose vocabulary is padded to another size.

Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by x TP, so a new TP size
often changes the padded size: dim 0 of the word embedding and of an untied output layer. Megatron's
checkpoint converter (tools/checkpoint, the savers' padding step) keeps the stored rows up to the
new size and fills any further rows with copies of the stored tensor's last row; megafab does the
same when it converts (padded_rows: a full tensor) and when it loads a checkpoint padded otherwise
(adapt_padded_vocab: this rank's boxes, model and optimizer state). The fp32 main params follow the
weights (copies of the stored main param's last row); the optimizer moments of the new rows start
at zero. The real vocabulary itself must match the checkpoint's (its args record vocab_size).
Because the padded logits enter the softmax, the rule decides the loss: converting and resharding
give the same rows, hence the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megafab.checkpoint.boxes import Box
from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.layout import MAIN_PARAM, STEP, Shard, split_key
from megafab.param_names import VOCAB_PADDED


def padded_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` [V_stored, ...] with `rows` rows by the rule above (the first rows kept, copies of
    the last row added)."""
    extra = rows - weight.shape[0]
    if extra <= 0:
        return weight[:rows]
    return torch.cat([weight, weight[-1:].expand(extra, *weight.shape[1:])])


@dataclass
class PaddingFill:
    """This rank's padding rows still to be filled after the checkpoint's read: each target is
    (key, the view of its rows, its box) and takes copies of the key's stored last row."""

    saved_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    targets: list[tuple[str, torch.Tensor, Box]] = field(default_factory=list)

    def fill(self, source) -> None:
        """Collective (every rank calls it, with or without rows of its own): read the last stored
        row of each key this rank pads and copy it into the padding rows."""
        last: dict[str, Shard] = {}
        for key, view, _ in self.targets:
            if key not in last:
                shape = self.saved_shapes[key]
                box = Box((shape[0] - 1, *[0] * (len(shape) - 1)), (1, *shape[1:]))
                last[key] = Shard(shape, [box], [torch.empty(box.sizes, dtype=view.dtype)])
        source.read(last)
        for key, view, box in self.targets:
            columns = tuple(slice(o, o + n) for o, n in zip(box.offsets[1:], box.sizes[1:]))
            view.copy_(last[key].views[0][0][columns].expand_as(view))


def _split_rows(box: Box, rows: int) -> tuple[int, Box | None]:
    """How many of the box's rows are below `rows`, and the box of the rest (None when none)."""
    kept = max(0, min(box.offsets[0] + box.sizes[0], rows) - box.offsets[0])
    if kept == box.sizes[0]:
        return kept, None
    return kept, Box((box.offsets[0] + kept, *box.offsets[1:]), (box.sizes[0] - kept, *box.sizes[1:]))


def _vocab_keys(stored: dict):
    for key, md in stored.items():
        name, kind = split_key(key)
        if name in VOCAB_PADDED and kind != STEP and hasattr(md, "size"):
            yield key, tuple(md.size)


def adapt_padded_vocab(shards: dict[str, Shard], stored: dict, saved_vocab_size: int | None,
                       model_cfg, path: str) -> tuple[str | None, PaddingFill | None]:
    """Where the checkpoint's padded vocabulary differs from this model's: request only the stored
    rows this model keeps, zero the new rows' optimizer moments now, and return the PaddingFill that
    copies the last stored row into the new weight rows after the read (None, on every rank, when
    every padded size matches), with the note to print."""
    padded = model_cfg.padded_vocab_size
    changed = [(key, shape) for key, shape in _vocab_keys(stored) if shape[0] != padded]
    if not changed:
        return None, None
    vocab = model_cfg.vocab_size
    saved_rows = changed[0][1][0]
    fill = PaddingFill()
    for key, saved_shape in changed:
        shard = shards.get(key)
        if shard is None or saved_shape[1:] != shard.global_shape[1:]:
            continue  # another stage's tensor, or a different model: check_shards explains
        if saved_vocab_size != vocab or vocab > saved_shape[0]:
            raise CheckpointError(
                f"{path}: checkpoint tensor {key!r} has {saved_shape[0]} rows for a vocabulary of "
                f"{saved_vocab_size} tokens, but this model's vocabulary has {vocab} tokens; a "
                f"different padding is resharded, a different vocabulary is not: use the "
                f"checkpoint's tokenizer (or --vocab-size {saved_vocab_size})")
        kept_rows = Shard(saved_shape)
        moment = split_key(key)[1] not in (None, MAIN_PARAM)
        for box, view in zip(shard.boxes, shard.views):
            kept, new = _split_rows(box, saved_shape[0])
            if kept:
                kept_rows.add(Box(box.offsets, (kept, *box.sizes[1:])), view[:kept])
            if new is not None and moment:
                view[kept:].zero_()
            elif new is not None:
                fill.saved_shapes[key] = saved_shape
                fill.targets.append((key, view[kept:], new))
        shards[key] = kept_rows
    note = (f"the checkpoint's vocabulary of {vocab} tokens is padded to {saved_rows} rows, this model's "
            f"to {padded}: the first {min(saved_rows, padded)} rows are loaded"
            + (", the new rows are copies of the last one (Megatron's rule), with zero optimizer state"
               if padded > saved_rows else ""))
    return note, fill
