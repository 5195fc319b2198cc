"""Blocks: the unit of work of both pipelines. A bounded run of input records goes in; its documents,
tokenized and packed, with their cleaning verdicts and fingerprints, come out.

read_blocks(sources, keys, block_bytes, select) -> iterator of Block, in input order
process_block(block) -> BlockResult   (in a worker that called init_worker(context) first)

What a document becomes follows Megatron's preprocess_data.py (Encoder.encode), for each --json-keys
key separately:
  - a string value is one "sentence"; a list of strings (pre-split sentences) is several;
  - each sentence is tokenized; a sentence with no tokens is dropped (an empty or, for SentencePiece
    models that strip it, whitespace-only text has none);
  - --append-eod appends eod to the last sentence, only when the document has at least one token;
  - a document with no tokens is still a document: an entry in the index with no sequence at all
    (document_indices repeats), not a sequence of length 0;
  - very long texts are tokenized whole (Megatron cuts only when splitting sentences).
megafab differs from Megatron only where Megatron crashes: blank lines are skipped (Megatron's
json.loads fails on them), and a malformed line, a missing key or non-UTF-8 bytes is one error
naming the file and line (or counted and skipped with --skip-bad-lines).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from megafab.data.errors import DataError
from megafab.data.preprocess.cleaning import CleaningOptions, DocumentCleaner
from megafab.data.preprocess.encoders import Encoder, TokenizerSpec, build_encoder
from megafab.data.readers import InputSource, jsonl_lines, read_records

DEFAULT_BLOCK_BYTES = 4 << 20


@dataclass
class Block:
    index: int
    path: str
    records: list[tuple[int, bytes | dict]]  # (line or row number, raw jsonl line or column dict)
    source_bytes: int  # bytes of the input file consumed by this block (for progress)


@dataclass
class PackedKey:
    """One key's tokenized documents of a block, back to back."""

    tokens: np.ndarray  # all ids
    sequence_lengths: np.ndarray  # int32, one per sequence
    sequences_per_document: np.ndarray  # int64, 0 for an empty document
    tokens_per_document: np.ndarray  # int64

    def select(self, keep: np.ndarray) -> PackedKey:
        """Only the documents where keep is True."""
        if keep.all():
            return self
        return PackedKey(
            self.tokens[np.repeat(keep, self.tokens_per_document)],
            self.sequence_lengths[np.repeat(keep, self.sequences_per_document)],
            self.sequences_per_document[keep],
            self.tokens_per_document[keep],
        )


@dataclass
class BlockResult:
    index: int
    documents: int  # records that became documents (bad lines excluded)
    verdicts: list[str | None]  # per document: the cleaning rule that removed it, or None
    text_bytes: np.ndarray  # per document: UTF-8 bytes of its text fields as read
    keys: dict[str, PackedKey]  # tokens of the documents the cleaning rules kept (verdict None)
    digests: list | None = None  # per kept document, when exact dedup is on
    signatures: list | None = None  # per kept document, when near dedup is on
    bad: list[str] = field(default_factory=list)
    html_bytes_removed: int = 0
    source_bytes: int = 0


def read_blocks(
    sources: list[InputSource],
    keys: list[str],
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    select: Callable[[int], bool] | None = None,
) -> Iterator[Block]:
    """Blocks of about block_bytes of input, in order. select(i) chooses records by their position i
    among all physical lines/rows of all sources (Megatron's --partitions counts blank lines too)."""
    index = 0
    position = 0
    for source in sources:
        records: list[tuple[int, bytes | dict]] = []
        size = 0
        consumed = last = 0
        if source.kind == "jsonl":
            stream = ((n, line, len(line), at) for n, line, at in jsonl_lines(source.path))
        else:
            stream = (
                (n, row, sum(len(v) for v in row.values() if isinstance(v, str)), 0)
                for n, row in read_records(source, keys)
            )
        for number, raw, nbytes, at in stream:
            consumed = at or consumed + nbytes
            chosen = select is None or select(position)
            position += 1
            if not chosen or (isinstance(raw, bytes) and not raw.strip()):
                continue
            records.append((number, raw))
            size += nbytes
            if size >= block_bytes:
                yield Block(index, source.path, records, consumed - last)
                index, records, size, last = index + 1, [], 0, consumed
        if records or consumed > last:
            yield Block(index, source.path, records, consumed - last)
            index += 1


# ---- worker side ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerContext:
    spec: TokenizerSpec
    vocab_size: int
    eod: int
    keys: tuple[str, ...]
    append_eod: bool
    cleaning: CleaningOptions
    html_extractor: str


_worker: dict = {}


def init_worker(context: WorkerContext) -> None:
    _worker["context"] = context
    _worker["encoder"] = build_encoder(context.spec, context.vocab_size, context.eod, note=lambda m: None)
    cleaning = context.cleaning
    active = (
        cleaning.strip_html
        or cleaning.min_chars
        or cleaning.quality
        or cleaning.lang
        or cleaning.fingerprints
    )
    _worker["cleaner"] = DocumentCleaner(cleaning, context.html_extractor) if active else None


def _parse(path: str, number: int, raw: bytes | dict, keys: tuple[str, ...]) -> dict[str, list[str]]:
    """The key -> sentences of one record, or DataError naming the line."""
    if isinstance(raw, bytes):
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}:{number}: not UTF-8 ({e.reason} at byte {e.start}); re-encode the file as UTF-8"
            ) from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: malformed JSON ({e.msg} at column {e.colno})") from None
    else:
        record = raw
    if not isinstance(record, dict):
        raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
    texts = {}
    for key in keys:
        value = record.get(key)
        if isinstance(value, str):
            texts[key] = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            texts[key] = value
        else:
            raise DataError(
                f"{path}:{number}: no string (or list of strings) field {key!r} "
                f"(--json-keys {' '.join(keys)})"
            )
    return texts


def _pack(encoder: Encoder, documents: list[list[str]], append_eod: bool) -> PackedKey:
    flat_texts = [s for sentences in documents for s in sentences]
    ids = encoder.encode(flat_texts)
    eod = np.array([encoder.eod], dtype=np.int64)
    pieces, lengths, seqs, toks = [], [], [], []
    at = 0
    for sentences in documents:
        doc = [x for x in ids[at : at + len(sentences)] if len(x)]
        at += len(sentences)
        if doc and append_eod:
            doc[-1] = np.concatenate([doc[-1].astype(np.int64, copy=False), eod])
        pieces.extend(doc)
        lengths.extend(len(x) for x in doc)
        seqs.append(len(doc))
        toks.append(sum(len(x) for x in doc))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return PackedKey(
        tokens,
        np.asarray(lengths, dtype=np.int32),
        np.asarray(seqs, dtype=np.int64),
        np.asarray(toks, dtype=np.int64),
    )


def process_block(block: Block, tokenize: bool = True, drop: frozenset = frozenset()) -> BlockResult:
    """Parse, clean and tokenize block. tokenize=False computes only verdicts and fingerprints (the Ray
    pipeline's first pass); drop names documents (by their rank among those the cleaning rules keep)
    that the deduplicator removed, so they are neither tokenized nor returned."""
    context: WorkerContext = _worker["context"]
    encoder: Encoder = _worker["encoder"]
    cleaner: DocumentCleaner | None = _worker["cleaner"]
    keys = context.keys
    verdicts: list[str | None] = []
    text_bytes: list[int] = []
    kept: dict[str, list[list[str]]] = {key: [] for key in keys}
    digests, signatures = [], []
    bad: list[str] = []
    html_removed = 0
    rank = -1
    for number, raw in block.records:
        try:
            texts = _parse(block.path, number, raw, keys)
        except DataError as e:
            bad.append(str(e))
            continue
        text_bytes.append(sum(len(s.encode("utf-8", "surrogatepass")) for v in texts.values() for s in v))
        verdict = None
        if cleaner is not None:
            if cleaner.html_text is not None:
                cleaned = {k: [cleaner.transform(s) for s in v] for k, v in texts.items()}
                html_removed += text_bytes[-1] - sum(
                    len(s.encode("utf-8", "surrogatepass")) for v in cleaned.values() for s in v
                )
                texts = cleaned
            joined = "\n".join(s for v in texts.values() for s in v)
            verdict = cleaner.violation(joined)
            if verdict is None and cleaner.options.fingerprints:
                digest, signature = cleaner.fingerprint(joined)
                digests.append(digest)
                signatures.append(signature)
        if verdict is None:
            rank += 1
            if rank in drop:
                verdict = "dropped"
        verdicts.append(verdict)
        if verdict is None and tokenize:
            for key in keys:
                kept[key].append(texts[key])
    packed = {key: _pack(encoder, kept[key], context.append_eod) for key in keys}
    for key, part in packed.items():
        if (
            part.tokens.size
            and not 0 <= int(part.tokens.min()) <= int(part.tokens.max()) < context.vocab_size
        ):
            bad_id = (
                int(part.tokens.max()) if part.tokens.max() >= context.vocab_size else int(part.tokens.min())
            )
            raise DataError(
                f"{block.path}: token id {bad_id} in --json-keys {key} is outside the tokenizer's "
                f"vocabulary [0, {context.vocab_size}); fix the ids or choose the matching tokenizer"
            )
    fingerprints = cleaner is not None and cleaner.options.fingerprints
    return BlockResult(
        block.index,
        len(verdicts),
        verdicts,
        np.asarray(text_bytes, dtype=np.int64),
        packed,
        digests if fingerprints and cleaner.options.dedup else None,
        signatures if fingerprints and cleaner.options.near_dedup is not None else None,
        bad,
        html_removed,
        block.source_bytes,
    )
