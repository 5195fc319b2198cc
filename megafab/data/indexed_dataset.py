"""Megatron's memory-mapped indexed dataset: the `.bin/.idx` pair, read and written byte for byte.

`.idx` (little-endian):
    9 bytes  magic b"MMIDIDX\\x00\\x00"
    uint64   version (1)
    uint8    dtype code (see DTYPE_CODES)
    uint64   sequence_count N
    uint64   document_count D (= documents + 1)
    int32[N] sequence lengths (in tokens)
    int64[N] sequence byte pointers into `.bin`
    int64[D] document indices: 0, ..., N (document d = sequences [doc[d], doc[d+1]))
    int8[N]  sequence modes, only for multimodal datasets (not flagged in the header)
`.bin` is the concatenated tokens, no header.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from megafab.data.errors import DataError
from megafab.progress import Progress

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


def dtype_for_vocab(vocab_size: int | None) -> type[np.number]:
    """Megatron's choice: uint16 when the vocabulary fits comfortably, int32 otherwise."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def index_file_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


class IndexedDataset:
    """Reader of one `.bin/.idx` pair; item i is sequence i as a numpy array.

    The .bin is memory-mapped; with mmap=False (--no-mmap-bin-files) each read opens the file and
    reads just that range (Megatron's file reader: for file systems where mmap is slow or scarce).
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True):
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f"{path}: file not found; a dataset prefix needs both {path_prefix}.bin "
                                f"and {path_prefix}.idx (pass the prefix without extension)")
        self._read_index(idx_path)
        self._check_bin(bin_path)
        self.bin_path = bin_path
        self.mmap = mmap
        self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r") if mmap and os.path.getsize(bin_path) \
            else None

    def _read_index(self, idx_path: str) -> None:
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < len(MAGIC):
            raise DataError(f"{idx_path}: truncated index ({size} bytes, shorter than the magic)")
        if header[: len(MAGIC)] != MAGIC:
            raise DataError(f"{idx_path}: wrong magic {header[:len(MAGIC)]!r}, expected {MAGIC!r}; "
                            "this is not a Megatron mmap index file")
        if len(header) < HEADER_BYTES:
            raise DataError(f"{idx_path}: truncated header ({size} bytes, need {HEADER_BYTES})")
        version, code, count, doc_count = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise DataError(f"{idx_path}: unsupported index version {version}, only version {VERSION} exists")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx_path}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        expected = HEADER_BYTES + count * (4 + 8) + doc_count * 8 + (count if self.multimodal else 0)
        if size < expected:
            raise DataError(f"{idx_path}: truncated index ({size} bytes, the header's {count} sequences and "
                            f"{doc_count} document indices need {expected}); rebuild it")
        self.dtype = DTYPE_CODES[code]
        mm = np.memmap(idx_path, dtype=np.uint8, mode="r")
        offset = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(mm, dtype="<i4", count=count, offset=offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(mm, dtype="<i8", count=count, offset=offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(mm, dtype="<i8", count=doc_count, offset=offset)
        offset += 8 * doc_count
        self.sequence_modes = (np.frombuffer(mm, dtype=np.int8, count=count, offset=offset)
                               if self.multimodal else None)
        docs = self.document_indices
        if doc_count == 0 or docs[0] != 0 or docs[-1] != count:
            raise DataError(f"{idx_path}: document indices must run from 0 to the sequence count {count}; "
                            "the index is corrupt")

    def _check_bin(self, bin_path: str) -> None:
        if len(self.sequence_lengths) == 0:
            return
        itemsize = np.dtype(self.dtype).itemsize
        needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
        actual = os.path.getsize(bin_path)
        if actual < needed:
            raise DataError(f"{bin_path}: data file is {actual} bytes but its index points up to byte "
                            f"{needed}; the .bin is truncated or belongs to another .idx")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx (to its end when length is None)."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        if length == 0:
            return np.empty(0, dtype=self.dtype)
        start = int(self.sequence_pointers[idx]) + offset * np.dtype(self.dtype).itemsize
        if not self.mmap:
            with open(self.bin_path, "rb") as f:
                f.seek(start)
                return np.fromfile(f, dtype=self.dtype, count=length)
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(int(idx))

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document doc (its sequences concatenated)."""
        beg, end = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        return np.concatenate([self.get(i) for i in range(beg, end)]) if end > beg else \
            np.empty(0, dtype=self.dtype)


class IndexedDatasetWriter:
    """Streams sequences into `.bin` and writes the `.idx` at finalize (same bytes as megatron-core).

    The index is kept as numpy chunks (12 bytes per sequence, 8 per document), not Python lists, so a
    corpus of 10^8 documents indexes in about 2 GB. `add_packed` appends a whole tokenized block at
    once (the preprocess fast path); `add_item` / `add_document` append one at a time.
    """

    _FLUSH = 1 << 16

    def __init__(self, bin_path: str, dtype: type[np.number] = np.int32, multimodal: bool = False):
        if np.dtype(dtype) not in CODE_OF_DTYPE:
            raise DataError(f"dtype {dtype} has no Megatron dtype code; use one of "
                            f"{[np.dtype(d).name for d in DTYPE_CODES.values()]}")
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        self.multimodal = multimodal
        try:
            self._file = open(bin_path, "wb")  # noqa: SIM115 - closed in finalize
        except OSError as e:
            raise DataError(f"{bin_path}: cannot write the dataset ({e.strerror}); choose a writable "
                            "--output-prefix") from None
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._modes: list[np.ndarray] = []
        self._pending_lengths: list[int] = []
        self._pending_doc_ends: list[int] = []
        self._pending_modes: list[int] = []
        self._count = 0  # sequences written, pending included

    def _write_tokens(self, tokens: np.ndarray) -> np.ndarray:
        cast = tokens.astype(self.dtype.newbyteorder("<"), copy=False)
        if tokens.size and cast.dtype != tokens.dtype and not np.array_equal(cast, tokens):
            raise DataError(f"{self.bin_path}: token values {tokens.min()}..{tokens.max()} do not fit "
                            f"{self.dtype.name}; write with a wider dtype (vocab >= 65500 needs int32)")
        try:
            self._file.write(memoryview(np.ascontiguousarray(cast)).cast("B"))
        except OSError as e:
            raise DataError(f"{self.bin_path}: write failed ({e.strerror}); free space or choose another "
                            "--output-prefix") from None
        return cast

    def _flush(self) -> None:
        if self._pending_lengths:
            self._lengths.append(np.asarray(self._pending_lengths, dtype="<i4"))
            self._pending_lengths = []
        if self._pending_doc_ends:
            self._doc_ends.append(np.asarray(self._pending_doc_ends, dtype="<i8"))
            self._pending_doc_ends = []
        if self._pending_modes:
            self._modes.append(np.asarray(self._pending_modes, dtype=np.int8))
            self._pending_modes = []

    def add_item(self, tokens: Sequence[int] | np.ndarray, mode: int = 0) -> None:
        """Append one sequence (does not end the document)."""
        cast = self._write_tokens(np.asarray(tokens))
        self._pending_lengths.append(cast.size)
        if self.multimodal:
            self._pending_modes.append(mode)
        self._count += 1
        if len(self._pending_lengths) >= self._FLUSH:
            self._flush()

    def end_document(self) -> None:
        self._pending_doc_ends.append(self._count)
        if len(self._pending_doc_ends) >= self._FLUSH:
            self._flush()

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Iterable[int] | None = None) -> None:
        """Append a document made of one sequence, or of consecutive sequences of the given lengths.

        lengths=[] appends a document with no sequence at all, as megatron-core's builder does for
        the empty documents of Megatron's preprocess_data.py.
        """
        array = np.asarray(tokens)
        if lengths is None:
            self.add_item(array)
        else:
            start = 0
            for length in lengths:
                self.add_item(array[start:start + length])
                start += length
        self.end_document()

    def add_packed(self, tokens: np.ndarray, sequence_lengths: np.ndarray, sequences_per_document: np.ndarray,
                   modes: np.ndarray | None = None) -> None:
        """Append many documents at once: their tokens back to back, each sequence's length, and how
        many sequences each document has (0 for an empty document)."""
        self._flush()
        self._write_tokens(np.asarray(tokens))
        lengths = np.asarray(sequence_lengths, dtype="<i4")
        self._lengths.append(lengths)
        self._doc_ends.append(self._count + np.cumsum(sequences_per_document, dtype=np.int64))
        if self.multimodal:
            modes = np.zeros(len(lengths)) if modes is None else modes
            self._modes.append(np.asarray(modes, dtype=np.int8))
        self._count += len(lengths)

    def add_index(self, path_prefix: str, progress=None) -> None:
        """Append a whole existing dataset (merge); its dtype must equal ours. progress: a
        megafab.progress.Progress told every byte of .bin copied."""
        other = IndexedDataset(path_prefix, multimodal=self.multimodal)
        if np.dtype(other.dtype) != self.dtype:
            raise DataError(f"{index_file_path(path_prefix)}: dtype {np.dtype(other.dtype).name} differs "
                            f"from the merged output's {self.dtype.name}; merge only datasets of one vocab")
        self._flush()
        self._lengths.append(np.array(other.sequence_lengths, dtype="<i4"))
        self._doc_ends.append(self._count + np.asarray(other.document_indices[1:], dtype=np.int64))
        if self.multimodal:
            self._modes.append(np.array(other.sequence_modes, dtype=np.int8))
        self._count += len(other)
        with open(other.bin_path, "rb") as f:
            while chunk := f.read(1 << 24):
                self._file.write(chunk)
                if progress is not None:
                    progress.update(len(chunk))

    @property
    def sequence_lengths(self) -> np.ndarray:
        self._flush()
        return np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype="<i4")

    @property
    def document_indices(self) -> np.ndarray:
        self._flush()
        return np.concatenate(self._doc_ends)

    def finalize(self, idx_path: str) -> None:
        self._file.close()
        lengths = self.sequence_lengths
        documents = self.document_indices
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        try:
            with open(idx_path, "wb") as f:
                f.write(MAGIC)
                code = CODE_OF_DTYPE[self.dtype]
                f.write(struct.pack("<QBQQ", VERSION, code, len(lengths), len(documents)))
                f.write(lengths.tobytes(order="C"))
                f.write(pointers.tobytes(order="C"))
                f.write(documents.astype("<i8", copy=False).tobytes(order="C"))
                if self.multimodal:
                    modes = np.concatenate(self._modes) if self._modes else np.zeros(0, np.int8)
                    f.write(modes.tobytes(order="C"))
        except OSError as e:
            raise DataError(f"{idx_path}: cannot write the index ({e.strerror}); free space or choose "
                            "another --output-prefix") from None


def merge_datasets(prefixes: Sequence[str], output_prefix: str, multimodal: bool = False) -> None:
    """Concatenate datasets in the given order into output_prefix; all must share one dtype."""
    if not prefixes:
        raise DataError("merge: no input datasets given")
    first = IndexedDataset(prefixes[0], multimodal=multimodal)
    writer = IndexedDatasetWriter(data_file_path(output_prefix), first.dtype, multimodal=multimodal)
    total = sum(os.path.getsize(data_file_path(p)) for p in prefixes if os.path.isfile(data_file_path(p)))
    progress = Progress(total, f"merge {len(prefixes)} datasets")
    try:
        for prefix in prefixes:
            writer.add_index(prefix, progress)
    finally:
        progress.close()
    writer.finalize(index_file_path(output_prefix))
