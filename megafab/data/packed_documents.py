"""--dataloader-inter-document-masking (Megatron HEAD): attention confined to each document of a sample.

megatron-core's GPTDataset.__getitem__ with inter_document_masking: the sample's document parts, as
_query_document_sample_shuffle_indices reads them from the .idx (document boundaries, not eod
tokens), give cu_seqlens [0, l1, l1 + l2, ..., s] (the extra label token taken off the last part,
a padded tail folded into it), right-padded with s to s + 1 entries so samples collate; max_seqlen
is the longest part; position_ids restart at 0 in each document; loss_mask is untouched (the last
token of a document still predicts the next document's first). pretrain_gpt.py feeds cu_seqlens to
attention as THD packed sequences (causal within each document); megafab turns them into the same
mask on the existing attention-mask path: a query attends to the keys at or before it in its own
document (inter_document_mask), under context parallelism as well (the whole sequence's mask).
"""

from __future__ import annotations

import numpy as np
import torch

from megafab.distributed.masked_attention import window_mask


def document_cu_seqlens(part_lengths: list[int], seq_length: int) -> torch.Tensor:
    """cu_seqlens [seq_length + 1] int32 of a sample whose seq_length + 1 tokens (with the label
    token) came from documents parts of `part_lengths` (before padding), megatron-core's way."""
    lengths = list(part_lengths)
    lengths[-1] -= 1  # the extra token is the last label, not an input
    if lengths[-1] == 0:
        lengths.pop()
    shortfall = seq_length - sum(lengths)
    if shortfall > 0:  # a padded (last) sample: the padding joins the last document
        if lengths:
            lengths[-1] += shortfall
        else:
            lengths.append(shortfall)
    cu = torch.full((seq_length + 1,), seq_length, dtype=torch.int32)
    cu[:len(lengths) + 1] = torch.from_numpy(np.cumsum([0] + lengths)).to(torch.int32)
    return cu


def document_fields(part_lengths: list[int], seq_length: int) -> dict[str, torch.Tensor]:
    """cu_seqlens [s + 1] int32, max_seqlen (int32 scalar) and position_ids [s] restarting at each
    document."""
    cu = document_cu_seqlens(part_lengths, seq_length)
    ids = document_ids(cu[None], seq_length)[0]
    starts = cu.long()[ids]  # the first position of each token's document
    return {"cu_seqlens": cu, "max_seqlen": (cu[1:] - cu[:-1]).max(),
            "position_ids": torch.arange(seq_length) - starts}


def document_ids(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """[b, s+1] padded cu_seqlens -> [b, s] int64: the index of each token's document."""
    positions = torch.arange(seq_length, device=cu_seqlens.device).expand(cu_seqlens.shape[0], -1)
    return torch.searchsorted(cu_seqlens[:, 1:].contiguous().long(), positions.contiguous(), right=True)


def inter_document_mask(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """[b, 1, s, s] bool, True where attention is NOT allowed: a later key, or another document's."""
    docs = document_ids(cu_seqlens, seq_length)
    positions = torch.arange(seq_length, device=cu_seqlens.device)
    masked = window_mask(positions, positions, None) | (docs[:, :, None] != docs[:, None, :])
    return masked.unsqueeze(1)


def attach_document_mask(batch: dict) -> dict:
    """A batch with cu_seqlens (and max_seqlen) -> the same batch with their attention_mask instead."""
    if batch.get("cu_seqlens") is None:
        return batch
    batch = dict(batch)
    cu = batch.pop("cu_seqlens")
    batch.pop("max_seqlen", None)
    batch["attention_mask"] = inter_document_mask(cu, batch["tokens"].shape[1])
    return batch


def document_masking_problems(cfg) -> list[str]:
    """--dataloader-inter-document-masking's rules: the attention paths that take its mask."""
    if not cfg.data.dataloader_inter_document_masking:
        return []
    m, p, out = cfg.model, cfg.parallel, []
    if p.context_parallel_size > 1 and p.cp_comm_type == "p2p":
        out.append(f"--dataloader-inter-document-masking with --context-parallel-size "
                   f"{p.context_parallel_size} and --cp-comm-type p2p: megafab's K/V ring has causal or "
                   f"full blocks, not masked ones; use --cp-comm-type allgather or a2a")
    if m.mtp_num_layers:
        out.append("--dataloader-inter-document-masking with --mtp-num-layers is not implemented in megafab "
                   "yet (megatron-core shifts MTP inputs within each packed document); drop one")
    return out
