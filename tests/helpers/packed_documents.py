"""Packed samples for --dataloader-inter-document-masking tests: random document boundaries and the
fields megafab's GPTDataset serves for them (cu_seqlens, max_seqlen, position_ids)."""

import torch

from megafab.data.packed_documents import document_fields


def part_lengths(seq_length: int, seed: int, documents: int = 4) -> list[int]:
    """Lengths of `documents` parts (each >= 2) of a sample's seq_length + 1 tokens."""
    g = torch.Generator().manual_seed(seed)
    while True:
        cuts = sorted((torch.randperm(seq_length - 1, generator=g)[:documents - 1] + 1).tolist())
        lengths = [b - a for a, b in zip([0] + cuts, cuts + [seq_length + 1])]
        if min(lengths) >= 2:
            return lengths


def packed_fields(seq_length: int, seed: int, documents: int = 4) -> dict[str, torch.Tensor]:
    return document_fields(part_lengths(seq_length, seed, documents), seq_length)


def packed_batch(seq_length: int, micro_batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """cu_seqlens [b, s+1], max_seqlen [b], position_ids [b, s] of `micro_batch` packed samples."""
    rows = [packed_fields(seq_length, seed + i, documents=3 + i % 2) for i in range(micro_batch)]
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
