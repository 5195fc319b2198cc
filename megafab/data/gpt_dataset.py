"""GPTDataset: fixed-length causal-LM samples over the documents of one indexed dataset."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import torch

from megafab.data.errors import DataError
from megafab.data.index_cache import cached_arrays
from megafab.data.packed_documents import document_fields
from megafab.data.sample_index import build_gpt_indices
from megafab.data.token_range import check_sample

PAD_TOKEN_ID = -1  # used when the tokenizer has no pad id; never a real token


class GPTDataset(torch.utils.data.Dataset):
    """Samples of seq_length tokens drawn from `documents` of `indexed` (Megatron's order).

    Item i is a dict of tensors: tokens [s] int64, labels [s] int64 (tokens shifted by one),
    loss_mask [s] float32, position_ids [s] int64 and, only with reset_attention_mask,
    attention_mask [1, s, s] bool where True means "masked out" (Megatron's convention). With
    inter_document_masking (which overrides reset_*): cu_seqlens [s+1] int32 and max_seqlen instead,
    position_ids restarting at each document (megafab.data.packed_documents).
    """

    def __init__(self, indexed, dataset_path: str | None, documents: np.ndarray, num_samples: int | None,
                 split_name: str, seq_length: int, seed: int, eod: int, pad: int | None = None,
                 eod_mask_loss: bool = False, reset_position_ids: bool = False,
                 reset_attention_mask: bool = False, cache_path: str | None = None,
                 barrier: Callable[[], None] | None = None, is_builder: bool = True,
                 vocab_size: int | None = None, inter_document_masking: bool = False):
        tokens = int(np.sum(np.asarray(indexed.sequence_lengths)[documents], dtype=np.int64))
        if tokens == 0:
            raise DataError(f"{dataset_path or 'the mock dataset'}: the {split_name} split's "
                            f"{len(documents)} documents hold no tokens; preprocess the data again")
        self.indexed = indexed
        self.vocab_size = vocab_size
        self.dataset_path = dataset_path
        self.documents = documents
        self.num_samples = num_samples
        self.split_name = split_name
        self.seq_length = seq_length
        self.eod = eod
        self.pad = PAD_TOKEN_ID if pad is None or pad == eod else pad
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.inter_document_masking = inter_document_masking
        self.description = json.dumps({
            "class": "GPTDataset", "dataset_path": dataset_path, "num_samples": num_samples,
            "split": split_name, "documents": [int(documents[0]), int(documents[-1]) + 1]
            if len(documents) else [0, 0], "seed": seed, "seq_length": seq_length,
        }, indent=4)
        self.document_index, self.sample_index, self.shuffle_index = cached_arrays(
            cache_path, f"GPTDataset-{split_name}", self.description,
            ["document_index", "sample_index", "shuffle_index"],
            lambda: build_gpt_indices(indexed.sequence_lengths, documents, num_samples, seq_length, seed),
            barrier, is_builder)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def sample_parts(self, idx: int) -> tuple[np.ndarray, list[int]]:
        """The seq_length + 1 tokens of sample idx (in served order), padded with pad if short, and
        the lengths of its documents' parts (before padding)."""
        s = int(self.shuffle_index[idx])
        doc_beg, off_beg = (int(x) for x in self.sample_index[s])
        doc_end, off_end = (int(x) for x in self.sample_index[s + 1])
        if doc_beg == doc_end:
            parts = [self.indexed.get(int(self.document_index[doc_beg]), off_beg, off_end - off_beg + 1)]
        else:
            parts = [self.indexed.get(int(self.document_index[doc_beg]), off_beg)]
            parts += [self.indexed.get(int(self.document_index[d])) for d in range(doc_beg + 1, doc_end)]
            parts.append(self.indexed.get(int(self.document_index[doc_end]), 0, off_end + 1))
        tokens = np.concatenate(parts).astype(np.int64)
        lengths = [len(part) for part in parts]
        check_sample(tokens, self.vocab_size,
                     lambda: f"{self.dataset_path or 'the mock dataset'}: {self.split_name} sample {idx}")
        if len(tokens) < self.seq_length + 1:
            tokens = np.concatenate([tokens, np.full(self.seq_length + 1 - len(tokens), self.pad, np.int64)])
        return tokens, lengths

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text, lengths = self.sample_parts(int(idx))
        text = torch.from_numpy(text)
        tokens, labels = text[:-1].clone(), text[1:].clone()
        documents = self.inter_document_masking
        sample = ltor_masks_and_position_ids(tokens, self.eod, self.eod_mask_loss,
                                             self.reset_position_ids and not documents,
                                             self.reset_attention_mask and not documents)
        if documents:
            sample.update(document_fields(lengths, self.seq_length))
        sample["loss_mask"][labels == self.pad] = 0.0
        tokens[tokens == self.pad] = 0
        labels[labels == self.pad] = 0
        sample["tokens"], sample["labels"] = tokens, labels
        return sample


def ltor_masks_and_position_ids(tokens: torch.Tensor, eod: int, eod_mask_loss: bool, reset_position_ids: bool,
                                reset_attention_mask: bool) -> dict[str, torch.Tensor]:
    """loss_mask [s], position_ids [s] and (reset_attention_mask only) attention_mask [1, s, s].

    A document starts after each eod token: with reset_position_ids positions restart there, with
    reset_attention_mask tokens cannot attend across it.
    """
    s = tokens.numel()
    is_eod = tokens == eod
    loss_mask = torch.ones(s, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.long)
    out = {"loss_mask": loss_mask}
    # segment[j] = number of eod tokens strictly before j
    segment = torch.cumsum(is_eod.long(), 0) - is_eod.long()
    if reset_position_ids:
        segment_start = torch.zeros(s, dtype=torch.long)
        after_eod = torch.nonzero(is_eod[:-1]).flatten() + 1
        segment_start[after_eod] = after_eod
        position_ids = position_ids - torch.cummax(segment_start, 0).values
    out["position_ids"] = position_ids
    if reset_attention_mask:
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
        allowed = causal & (segment[:, None] == segment[None, :])
        out["attention_mask"] = (~allowed).unsqueeze(0)
    return out
