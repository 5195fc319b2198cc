"""Blocks: the unit of work of both pipelines. A bounded run of input records goes in; its documents,
tokenized and packed, with their cleaning verdicts and fingerprints, come out.

read_blocks(sources, keys, block_bytes, select) -> iterator of Block, in input order
process_block(block) -> BlockResult   (in a worker that called init_worker(context) first)

A plain jsonl file is cut into spans at line starts (cut_spans) and each worker reads its own span:
the parent neither reads nor ships the text. Compressed jsonl, parquet and datasets, and lines
chosen by --partitions, are read by the parent into records. A document becomes what Megatron's
preprocess_data.py (Encoder.encode) makes of it, for each --json-keys key separately (_pack);
megafab differs only where Megatron crashes: blank lines are skipped, and a malformed line, a
missing key or non-UTF-8 bytes is one error naming the file and line (or counted and skipped with
--skip-bad-lines).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from megafab.data.errors import DataError
from megafab.data.indexed_dataset import dtype_for_vocab
from megafab.data.preprocess.cleaning import CleaningOptions, DocumentCleaner
from megafab.data.preprocess.encoders import Encoder, TokenizerSpec, build_encoder
from megafab.data.readers import InputSource, jsonl_lines, read_records

DEFAULT_BLOCK_BYTES = 4 << 20


@dataclass
class Block:
    index: int
    path: str
    records: list[tuple[int, bytes | dict]] | None  # (line or row number, raw jsonl line or column dict)
    source_bytes: int  # bytes of the input file consumed by this block (for progress)
    span: tuple[int, int] | None = None  # [start, end) of a plain jsonl file, read by the worker

    def read_records(self) -> list[tuple[int, bytes | dict]]:
        """The records, reading the span (lines numbered from its start) when the parent did not."""
        if self.records is not None:
            return self.records
        start, end = self.span
        try:
            with open(self.path, "rb") as f:
                data = os.pread(f.fileno(), end - start, start)
        except OSError as e:
            raise DataError(f"--input {self.path}: cannot read ({e.strerror})") from None
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()  # the file's last line ends with a newline
        return [(n, line) for n, line in enumerate(lines, 1) if line.strip()]


@dataclass
class PackedKey:
    """One key's tokenized documents of a block, back to back."""

    tokens: np.ndarray | str  # all ids (or, between a worker and the writer, the file holding them)
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
    bad: list[tuple[int, str]] = field(default_factory=list)  # (record number in the block, reason)
    html_bytes_removed: int = 0
    source_bytes: int = 0
    path: str = ""
    span: tuple[int, int] | None = None

    def bad_line_label(self, number: int) -> str:
        """'file:line' of the block's record `number`. A span's records are numbered from its start;
        the lines before the span are counted only here, when an error is reported."""
        if self.span is not None:
            number += count_lines(self.path, self.span[0])
        return f"{self.path}:{number}"


def count_lines(path: str, end: int) -> int:
    """Newlines in the first `end` bytes of path."""
    lines = 0
    with open(path, "rb") as f:
        while end > 0 and (chunk := f.read(min(end, 1 << 24))):
            lines += chunk.count(b"\n")
            end -= len(chunk)
    return lines


MIN_TAIL_SPAN = 1 << 18


def cut_spans(path: str, block_bytes: int, workers: int = 1) -> list[tuple[int, int]]:
    """[start, end) byte spans of about block_bytes covering the file, each starting at a line start.
    For workers > 1 the last spans shrink (each 1 / (2 x workers) of what is left, down to 256 KiB)
    so that the workers run out of work together rather than one block apart."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        while True:
            left = size - cuts[-1]
            step = block_bytes
            if workers > 1:
                step = min(block_bytes, max(MIN_TAIL_SPAN, left // (2 * workers)))
            if step >= left:
                break
            f.seek(cuts[-1] + step)
            f.readline()  # to the next line start
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    return list(zip(cuts, cuts[1:] + [size]))


def is_plain_jsonl(source: InputSource) -> bool:
    return source.kind == "jsonl" and not source.path.endswith((".gz", ".zst"))


def read_blocks(
    sources: list[InputSource],
    keys: list[str],
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    select: Callable[[int], bool] | None = None,
    workers: int = 1,
) -> Iterator[Block]:
    """Blocks of about block_bytes of input, in order, for `workers` processes (cut_spans). select(i)
    chooses records by their position i among all physical lines/rows of all sources (Megatron's
    --partitions counts blank lines too)."""
    index = 0
    position = 0
    for source in sources:
        if select is None and is_plain_jsonl(source):
            for start, end in cut_spans(source.path, block_bytes, workers):
                yield Block(index, source.path, None, end - start, (start, end))
                index += 1
            continue
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


def utf8_bytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _parse(raw: bytes | dict, keys: tuple[str, ...]) -> dict[str, list[str]]:
    """The key -> sentences of one record, or DataError saying what is wrong with it."""
    if isinstance(raw, bytes):
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            reason = f"not UTF-8 ({e.reason} at byte {e.start}); re-encode the file as UTF-8"
            raise DataError(reason) from None
        except json.JSONDecodeError as e:
            raise DataError(f"malformed JSON ({e.msg} at column {e.colno})") from None
    else:
        record = raw
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}")
    texts = {}
    for key in keys:
        value = record.get(key)
        if isinstance(value, str):
            texts[key] = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            texts[key] = value
        else:
            raise DataError(f"no string (or list of strings) field {key!r} (--json-keys {' '.join(keys)})")
    return texts


def _pack(encoder: Encoder, documents: list[list[str]], append_eod: bool) -> PackedKey:
    """One key's documents (each a list of sentences) tokenized and packed as Megatron's
    preprocess_data.py does: a string value is one sentence, a list of strings several; each
    sentence is tokenized and one with no tokens is dropped (an empty or, for SentencePiece models
    that strip it, whitespace-only text has none); --append-eod appends eod to the last sentence,
    only when the document has at least one token; a document with no tokens is still a document,
    an index entry with no sequence at all (document_indices repeats), not a sequence of length 0;
    very long texts are tokenized whole (Megatron cuts only when splitting sentences)."""
    ids = encoder.encode([s for sentences in documents for s in sentences])
    dtype = ids[0].dtype if ids else np.int64  # the engine's (gigatoken: uint32), half of int64
    eod = np.array([encoder.eod], dtype=dtype) if append_eod else None
    pieces, lengths, seqs, toks = [], [], [], []
    at = 0
    for sentences in documents:
        doc = [x for x in ids[at : at + len(sentences)] if len(x)]
        at += len(sentences)
        pieces += doc
        lengths += map(len, doc)
        tokens = sum(map(len, doc))
        if doc and append_eod:  # eod ends the last sentence
            pieces.append(eod)
            lengths[-1] += 1
            tokens += 1
        seqs.append(len(doc))
        toks.append(tokens)
    return PackedKey(
        np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64),
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
    bad: list[tuple[int, str]] = []
    html_removed = 0
    rank = -1
    for number, raw in block.read_records():
        try:
            texts = _parse(raw, keys)
        except DataError as e:
            bad.append((number, str(e)))
            continue
        text_bytes.append(sum(map(utf8_bytes, (s for v in texts.values() for s in v))))
        verdict = None
        if cleaner is not None:
            if cleaner.html_text is not None:
                cleaned = {k: [cleaner.transform(s) for s in v] for k, v in texts.items()}
                html_removed += text_bytes[-1] - sum(
                    map(utf8_bytes, (s for v in cleaned.values() for s in v))
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
        low, high = (int(part.tokens.min()), int(part.tokens.max())) if part.tokens.size else (0, 0)
        if not 0 <= low <= high < context.vocab_size:
            bad_id = high if high >= context.vocab_size else low
            raise DataError(
                f"{block.path}: token id {bad_id} in --json-keys {key} is outside the tokenizer's "
                f"vocabulary [0, {context.vocab_size}); fix the ids or choose the matching tokenizer"
            )
        part.tokens = part.tokens.astype(dtype_for_vocab(context.vocab_size))  # the .bin's dtype: 1/4 to ship
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
        block.path,
        block.span,
    )
