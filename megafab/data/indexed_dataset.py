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
    """Streams sequences into `.bin` and writes the `.idx` at finalize (same bytes as megatron-core)."""

    def __init__(self, bin_path: str, dtype: type[np.number] = np.int32, multimodal: bool = False):
        if np.dtype(dtype) not in CODE_OF_DTYPE:
            raise DataError(f"dtype {dtype} has no Megatron dtype code; use one of "
                            f"{[np.dtype(d).name for d in DTYPE_CODES.values()]}")
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        self.multimodal = multimodal
        self._file = open(bin_path, "wb")  # noqa: SIM115 - closed in finalize
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.sequence_modes: list[int] = []

    def add_item(self, tokens: Sequence[int] | np.ndarray, mode: int = 0) -> None:
        """Append one sequence (does not end the document)."""
        array = np.asarray(tokens)
        cast = array.astype(self.dtype)
        if array.size and not np.array_equal(cast, array):
            raise DataError(f"{self.bin_path}: token values {array.min()}..{array.max()} do not fit "
                            f"{self.dtype.name}; write with a wider dtype (vocab >= 65500 needs int32)")
        self._file.write(cast.astype(self.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
        self.sequence_lengths.append(cast.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Iterable[int] | None = None) -> None:
        """Append a document made of one sequence, or of consecutive sequences of the given lengths."""
        array = np.asarray(tokens)
        if lengths is None:
            self.add_item(array)
        else:
            start = 0
            for length in lengths:
                self.add_item(array[start:start + length])
                start += length
        self.end_document()

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (merge); its dtype must equal ours."""
        other = IndexedDataset(path_prefix, multimodal=self.multimodal)
        if np.dtype(other.dtype) != self.dtype:
            raise DataError(f"{index_file_path(path_prefix)}: dtype {np.dtype(other.dtype).name} differs "
                            f"from the merged output's {self.dtype.name}; merge only datasets of one vocab")
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((base + other.document_indices[1:]).tolist())
        if self.multimodal:
            self.sequence_modes.extend(other.sequence_modes.tolist())
        with open(other.bin_path, "rb") as f:
            while chunk := f.read(1 << 24):
                self._file.write(chunk)

    def finalize(self, idx_path: str) -> None:
        self._file.close()
        lengths = np.asarray(self.sequence_lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[self.dtype], len(lengths),
                                len(self.document_indices)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.document_indices, dtype="<i8").tobytes(order="C"))
            if self.multimodal:
                f.write(np.asarray(self.sequence_modes, dtype=np.int8).tobytes(order="C"))


def merge_datasets(prefixes: Sequence[str], output_prefix: str, multimodal: bool = False) -> None:
    """Concatenate datasets in the given order into output_prefix; all must share one dtype."""
    if not prefixes:
        raise DataError("merge: no input datasets given")
    first = IndexedDataset(prefixes[0], multimodal=multimodal)
    writer = IndexedDatasetWriter(data_file_path(output_prefix), first.dtype, multimodal=multimodal)
    for prefix in prefixes:
        writer.add_index(prefix)
    writer.finalize(index_file_path(output_prefix))
