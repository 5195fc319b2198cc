"""--dataloader-inter-document-masking's samples equal Megatron-LM HEAD's GPTDataset (its own
__getitem__ and _query_document_sample_shuffle_indices, recorded in fixtures/megatron_inter_document.json
by fixtures/make_megatron_inter_document.py): tokens, labels, loss_mask, position_ids restarting at
each .idx document (also a document without an eod, and over --reset-position-ids), cu_seqlens padded
to s + 1 and max_seqlen, for every sample of two corpora' datasets; and the mask they make."""

import json
import os

import numpy as np
import pytest
import torch

from megafab.data.builder import build_gpt_datasets
from megafab.data.indexed_dataset import IndexedDatasetWriter
from megafab.data.packed_documents import inter_document_mask

HEAD = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "megatron_inter_document.json")))


class Tokenizer:
    eod = HEAD["eod"]
    pad = None
    vocab_size = 512


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("corpus") / "c_text_document")
    writer = IndexedDatasetWriter(prefix + ".bin", np.uint16)
    for doc in HEAD["documents"]:
        writer.add_document(np.asarray(doc))
    writer.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("case", HEAD["cases"], ids=lambda c: c["name"])
def test_samples_equal_megatron_lm_heads(prefix, case):
    r = case["resets"]
    train = build_gpt_datasets(prefix, "100,0,0", case["seq_length"], 1234, (case["samples"], None, None),
                               Tokenizer(), reset_position_ids=r, reset_attention_mask=r, eod_mask_loss=r,
                               inter_document_masking=True)[0]
    assert len(train) == len(case["items"])
    several = 0
    for i, theirs in enumerate(case["items"]):
        ours = train[i]
        assert sorted(ours) == sorted(theirs), i
        for key, value in theirs.items():
            assert ours[key].tolist() == value, (i, key)
        several += int((ours["cu_seqlens"][1:-1] < case["seq_length"]).sum()) > 0
    assert several > len(train) // 4  # many samples hold pieces of several documents


def test_mask_is_causal_within_each_document():
    s = 8
    cu = torch.tensor([[0, 3, 7, 8, 8, 8, 8, 8, 8], [0, 8, 8, 8, 8, 8, 8, 8, 8]], dtype=torch.int32)
    allowed = ~inter_document_mask(cu, s)[:, 0]
    docs = [[0, 0, 0, 1, 1, 1, 1, 2], [0] * 8]
    for b in range(2):
        for i in range(s):
            for j in range(s):
                assert allowed[b, i, j] == (j <= i and docs[b][i] == docs[b][j])
