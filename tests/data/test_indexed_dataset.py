"""The .bin/.idx format: the worked example byte for byte, dtype round trips, megatron-core both ways,
merges, and one clear error per kind of broken file."""

import struct
import warnings

import numpy as np
import pytest

from megafab.data.builder import open_indexed
from megafab.data.errors import DataError
from megafab.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetWriter,
    dtype_for_vocab,
    merge_datasets,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import indexed_dataset as mc


def write(prefix, docs, dtype):
    writer = IndexedDatasetWriter(prefix + ".bin", dtype)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize(prefix + ".idx")


def test_worked_example_byte_for_byte(tmp_path):
    prefix = str(tmp_path / "ex")
    write(prefix, [[10, 20, 30, 50256], [7, 8, 50256]], dtype_for_vocab(50257))
    assert open(prefix + ".bin", "rb").read().hex() == "0a0014001e0050c40700080050c4"
    idx = open(prefix + ".idx", "rb").read()
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 2, 3) + struct.pack("<2i", 4, 3)
                + struct.pack("<2q", 0, 8) + struct.pack("<3q", 0, 1, 2))
    assert len(idx) == 82 and idx == expected


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPE_CODES[code]
    rng = np.random.default_rng(code)
    docs = [rng.integers(0, 100, size=n).astype(dtype) for n in (5, 0, 17, 1)]
    prefix = str(tmp_path / "rt")
    writer = IndexedDatasetWriter(prefix + ".bin", dtype)
    writer.add_document(np.concatenate(docs[:2]), lengths=[5, 0])  # a two-sequence document
    writer.add_document(docs[2])
    writer.add_document(docs[3])
    writer.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype and len(ds) == 4 and ds.num_documents == 3
    assert ds.document_indices.tolist() == [0, 2, 3, 4]
    for i, doc in enumerate(docs):
        assert ds[i].dtype == dtype and np.array_equal(ds[i], doc)
    assert np.array_equal(ds.get(2, offset=3, length=4), docs[2][3:7])
    # megatron-core reads it identically
    theirs = mc.IndexedDataset(prefix)
    assert np.array_equal(theirs.sequence_lengths, ds.sequence_lengths)
    assert np.array_equal(theirs.document_indices, ds.document_indices)
    for i, doc in enumerate(docs):
        assert np.array_equal(theirs[i], doc)


def test_file_reads_without_mmap_equal_the_memory_map(tmp_path):
    """--no-mmap-bin-files: the same tokens through plain file reads, as megatron-core's
    IndexedDataset(mmap=False) reads them; no memory map of the .bin is opened."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 60000, size=n).astype(np.uint16) for n in (9, 1, 33, 4)]
    prefix = str(tmp_path / "nommap")
    write(prefix, docs, np.uint16)
    mapped, read = IndexedDataset(prefix), open_indexed(prefix, 60000, mmap=False)
    theirs = mc.IndexedDataset(prefix, mmap=False)
    assert read._bin is None and isinstance(mapped._bin, np.memmap)
    for i in range(len(docs)):
        assert np.array_equal(read[i], mapped[i]) and np.array_equal(read[i], theirs[i])
    assert np.array_equal(read.get(2, offset=5, length=7), docs[2][5:12])
    assert np.array_equal(read.document(3), docs[3])


def test_bytes_equal_megatron_core_builder_and_reads_its_files(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 70000, size=int(rng.integers(1, 30))) for _ in range(25)]
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    write(ours, docs, np.int32)
    builder = mc.IndexedDatasetBuilder(theirs + ".bin", dtype=np.int32)
    for doc in docs:
        builder.add_document(doc.astype(np.int32), [len(doc)])
    builder.finalize(theirs + ".idx")
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read()
    ds = IndexedDataset(theirs)
    assert all(np.array_equal(ds[i], d) for i, d in enumerate(docs))


def test_merge_equals_writing_the_concatenation(tmp_path):
    rng = np.random.default_rng(1)
    parts = [[rng.integers(0, 500, size=int(rng.integers(1, 9))) for _ in range(k)] for k in (3, 5, 2)]
    for i, part in enumerate(parts):
        write(str(tmp_path / f"p{i}"), part, np.uint16)
    merge_datasets([str(tmp_path / f"p{i}") for i in range(3)], str(tmp_path / "merged"))
    write(str(tmp_path / "whole"), [d for part in parts for d in part], np.uint16)
    for ext in (".bin", ".idx"):
        assert open(tmp_path / f"merged{ext}", "rb").read() == open(tmp_path / f"whole{ext}", "rb").read()


def test_merge_refuses_mixed_dtypes(tmp_path):
    write(str(tmp_path / "a"), [[1, 2]], np.uint16)
    write(str(tmp_path / "b"), [[1, 2]], np.int32)
    with pytest.raises(DataError, match="b.idx: dtype int32 differs"):
        merge_datasets([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"))


def corrupt(tmp_path, how):
    prefix = str(tmp_path / "bad")
    write(prefix, [[10, 20, 30, 50256], [7, 8, 50256]], np.uint16)
    idx, bin_ = open(prefix + ".idx", "rb").read(), open(prefix + ".bin", "rb").read()
    if how == "truncated idx":
        open(prefix + ".idx", "wb").write(idx[:60])
    elif how == "wrong magic":
        open(prefix + ".idx", "wb").write(b"NOTANIDX\x00" + idx[9:])
    elif how == "wrong version":
        open(prefix + ".idx", "wb").write(idx[:9] + struct.pack("<Q", 2) + idx[17:])
    elif how == "short bin":
        open(prefix + ".bin", "wb").write(bin_[:10])
    elif how == "missing bin":
        import os

        os.remove(prefix + ".bin")
    return prefix


@pytest.mark.parametrize("how,message", [
    ("truncated idx", r"bad.idx: truncated index \(60 bytes"),
    ("wrong magic", r"bad.idx: wrong magic"),
    ("wrong version", r"bad.idx: unsupported index version 2"),
    ("short bin", r"bad.bin: data file is 10 bytes but its index points up to byte 14"),
    ("missing bin", r"bad.bin: file not found"),
])
def test_broken_files_give_one_clear_error(tmp_path, how, message):
    prefix = corrupt(tmp_path, how)
    with pytest.raises(DataError, match=message):
        IndexedDataset(prefix)


def test_dtype_too_narrow_for_vocab(tmp_path):
    prefix = str(tmp_path / "narrow")
    write(prefix, [[1, 2, 3]], np.uint16)
    with pytest.raises(DataError, match="stored as uint16, which cannot hold the ids of a 100000-token"):
        open_indexed(prefix, 100000)
    assert len(open_indexed(prefix, 50257)) == 1


def test_writer_refuses_tokens_that_do_not_fit(tmp_path):
    writer = IndexedDatasetWriter(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(DataError, match="do not fit uint16"):
        writer.add_document([1, 70000])
