"""preprocess_data.py writes the bytes Megatron-LM's tools/preprocess_data.py writes, on an edge corpus.

How the expected hashes were obtained (once, then recorded here): Megatron-LM main at commit
d98e8a64dd (2026-08-22), run from its source tree with PYTHONPATH pointing at it, Python 3.11 (with
typing.override patched in from typing_extensions, the only 3.12 feature it needs) and the venv's
transformers 5.24 / tokenizers 0.23 / sentencepiece 0.2.3:

    python tools/preprocess_data.py --input edge.jsonl --json-keys text title --append-eod --workers 1 \\
        --output-prefix meg_gpt2 --tokenizer-type GPT2BPETokenizer \\
        --vocab-file fixtures/gpt2_tiny/vocab.json --merge-file fixtures/gpt2_tiny/merges.txt
    (and --tokenizer-type HuggingFaceTokenizer --tokenizer-model fixtures/hf_tiny,
         --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model fixtures/sp_tiny.model)

GPT2BPETokenizer loads `AutoTokenizer.from_pretrained("gpt2", vocab_file=..., merges_file=...)`, which
needs the hub offline; it ran from a directory holding ./gpt2/ = {the fixture's vocab.json and
merges.txt, config.json {"model_type": "gpt2"}, tokenizer_config.json {"model_max_length": 1024}}.
edge.jsonl is `write_edge_corpus` below. The sha256 of each output file is recorded in EXPECTED.

What Megatron does with each case (megafab/data/preprocess/blocks.py and encoders.py say the same):
  empty text            no tokens -> a document with no sequence (document_indices repeats), no eod
  whitespace-only       GPT-2 BPE gives tokens (+ eod); SentencePiece too (its dummy-prefix pieces)
  '<|endoftext|>' ...   GPT-2 / HF: parsed into the special token; SentencePiece: '<s>' '</s>' stay text
  non-ASCII, CRLF       tokenized as is; CRLF line terminators of the file itself are not part of text
  very long (~350 KB)   tokenized whole, one sequence
  a list of strings     one sequence per non-empty string, eod on the last
  HF post-processor     tokenizer(text).input_ids: the <s> bos the tokenizer.json adds is kept
Megatron's preprocess_data_fast.py differs on empty documents (it writes [eod] as a sequence); megafab
follows preprocess_data.py, the tool every Megatron user has.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from megafab.data.indexed_dataset import IndexedDataset
from megafab.data.preprocess import cli
from tests.helpers.preprocess import TOKENIZERS

EXPECTED = {  # sha256 of Megatron's outputs, see the module docstring
    "gpt2": {
        "text.bin": "56cb4e43a6bc45db0e8e013cd1333a88fcbaf8f431dabf2ba0d0ae65a83ee080",
        "text.idx": "9199040b94a65e96c9eb719a77e83a7ac58d61aa9fa3450296ad801b588093b4",
        "title.bin": "2e0b9e4fdef0d71ab3ce19a1813533fbbbefc842339f92abea9007acbdab5b9e",
        "title.idx": "e63db7db437bcbc26e99e8bc8dfac2b570ee9d45a8747840867c4f38476f593d",
    },
    "hf": {
        "text.bin": "f78f9635fa1c77d1ae989b1e411db89d18b3a11fe5835a468ff05564d15543ea",
        "text.idx": "70aa76cabfc71788d489d44473a41cff2c05aae04b58f846096b95650f2e0f39",
        "title.bin": "d9db00863546cc3c717b0f761fca3f5e34daca06c837d8441b4ef6c57d8770f2",
        "title.idx": "ad576f00714ae2fdafcb8c3cd5fb739aafff1ffecc54ffd7539e8d2c9cbf99a3",
    },
    "sp": {
        "text.bin": "a6c9d502b397b85093b3716d14a983f5e0ecac8a4fec307f90d918afd783ccea",
        "text.idx": "239430cc1aca1cf71ae432ed6b1c52aa65ace6010ac520cfb2b6eaadb3ab60b4",
        "title.bin": "b2ddd2b323c67f14d348bbb7a5b62a08d39abeac0bf9b9f25aa0664211ec8da7",
        "title.idx": "b0e7b107d3a6a91581ea31c31e3fe3d84c1d9036cfe258bf99a175619339a1e2",
    },
}
EXPECTED["hf_file"] = EXPECTED["hf"]  # the same tokenizer.json, given as a file


def edge_records():
    long_text = "".join(
        f"Paragraph {i}: the river runs past the old mill; 日本語 {i}.\n" for i in range(6000)
    )
    return [
        {"text": "An ordinary first document.", "title": "first"},
        {"text": "", "title": "empty text"},
        {"text": " ", "title": ""},
        {"text": "\n\n\t  \n", "title": "whitespace only"},
        {"text": "before<|endoftext|>after and <s> bos </s> eos <pad>", "title": "<|endoftext|>"},
        {"text": "<|endoftext|>", "title": "special only"},
        {"text": "Le chat dort. Der Hund schläft. 日本語のテキスト。 🎉 مرحبا", "title": "non-ASCII"},
        {"text": "line one\r\nline two\r\n\r\nline four\r", "title": "CRLF"},
        {"text": long_text, "title": "very long"},
        {"text": ["A pre-split first sentence.", "", " And a second one."], "title": "list"},
        {"text": "The last document.", "title": "last"},
    ]


def write_edge_corpus(path):
    # CRLF line terminators on every other line (Megatron reads in text mode, megafab in binary),
    # \u-escaped and raw UTF-8 alternately.
    with open(path, "w", encoding="utf-8", newline="") as f:
        for i, record in enumerate(edge_records()):
            f.write(json.dumps(record, ensure_ascii=i % 2 == 0) + ("\r\n" if i % 2 else "\n"))
    return path


def sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def preprocess(tmp_path, tokenizer, *extra, name="out"):
    corpus = write_edge_corpus(tmp_path / "edge.jsonl")
    prefix = tmp_path / name
    assert (
        cli.main(
            [
                "--input",
                str(corpus),
                "--json-keys",
                "text",
                "title",
                "--append-eod",
                "--output-prefix",
                str(prefix),
                *TOKENIZERS[tokenizer],
                *extra,
            ]
        )
        == 0
    )
    return prefix


@pytest.mark.parametrize("engine", ["gigatoken", "reference"])
@pytest.mark.parametrize("tokenizer", ["gpt2", "hf", "hf_file", "sp"])
def test_edge_corpus_bytes_equal_megatron(tmp_path, tokenizer, engine):
    prefix = preprocess(
        tmp_path, tokenizer, "--tokenizer-engine", engine, "--workers", "2", "--block-mb", "0.1"
    )
    got = {
        f"{key}.{ext}": sha(f"{prefix}_{key}_document.{ext}")
        for key in ("text", "title")
        for ext in ("bin", "idx")
    }
    assert got == EXPECTED[tokenizer]


def test_empty_documents_are_index_entries_without_sequences(tmp_path):
    ds = IndexedDataset(f"{preprocess(tmp_path, 'gpt2')}_text_document")
    assert ds.num_documents == len(edge_records())
    assert ds.document_indices[1] == ds.document_indices[2]  # "" -> no sequence, no eod
    assert len(ds) == 9 * 1 + 0 + 2  # nine one-sequence documents, the empty one, the list (its '' dropped)


def test_special_tokens_as_text_keeps_the_string(tmp_path):
    from megafab.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer("GPT2BPETokenizer", *TOKENIZERS["gpt2"][3::2])
    compatible = IndexedDataset(f"{preprocess(tmp_path, 'gpt2', name='c')}_text_document")
    safe = IndexedDataset(
        f"{preprocess(tmp_path, 'gpt2', '--special-tokens-as-text', name='s')}_text_document"
    )
    doc = 4  # "before<|endoftext|>after ..."
    assert (compatible.document(doc)[:-1] == tokenizer.eod).sum() == 1  # Megatron: an eod inside the text
    assert (safe.document(doc)[:-1] == tokenizer.eod).sum() == 0
    assert tokenizer.detokenize(safe.document(doc)[:-1]) == edge_records()[doc]["text"]
    for other in (0, 6, 8):  # documents without special strings are unchanged
        assert np.array_equal(safe.document(other), compatible.document(other))
