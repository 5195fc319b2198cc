"""tools/: corpus -> tokenizer -> preprocess (2 workers) round trip on real English, merges, bad input."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megafab.data.indexed_dataset import IndexedDataset
from megafab.data.tokenizers import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import corpus  # noqa: E402
import merge_datasets  # noqa: E402
import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def english(tmp_path_factory):
    out = tmp_path_factory.mktemp("english")
    train, valid = corpus.write_corpus(str(out))
    model = train_tokenizer.train(train, str(out / "english"), vocab_size=2048, max_chars=3_000_000)
    return out, train, valid, model


def sp_flags(model):
    return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]


def test_corpus_is_several_megabytes_of_clean_english(english):
    _, train, valid, _ = english
    docs = [json.loads(line)["text"] for path in (train, valid) for line in open(path, encoding="utf-8")]
    assert Path(train).stat().st_size > 5_000_000 and len(docs) > 1500
    assert Path(valid).stat().st_size > 200_000
    text = "\n".join(docs)
    for markup in ("**", "_Enter", "\\", "###"):
        assert markup not in text
    assert "HAMLET:\n[Aside]\nA little more than kin" in text and "1 In the beginning God created" in text


def test_preprocess_two_workers_decodes_back(english, capsys):
    out, train, _, model = english
    prefix = str(out / "english")
    assert (
        preprocess_data.main(
            [
                "--input",
                train,
                "--output-prefix",
                prefix,
                "--append-eod",
                "--workers",
                "2",
                "--log-interval",
                "500",
                *sp_flags(model),
            ]
        )
        == 0
    )
    report = capsys.readouterr()
    assert "docs/s" in report.out and "MB/s" in report.out and "docs/s" in report.err
    print(report.out)  # measured throughput, visible with -s
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    ds = IndexedDataset(prefix + "_text_document")
    docs = [json.loads(line)["text"] for line in open(train, encoding="utf-8")]
    assert ds.num_documents == len(docs) and ds.dtype == np.uint16
    for i in range(0, len(docs), 7):
        tokens = ds.document(i)
        assert tokens[-1] == tokenizer.eod
        assert tokenizer.detokenize(tokens[:-1]) == docs[i]


def test_partitions_and_merge_tool_equal_one_pass(tmp_path, english):
    *_, model = english
    lines = [json.dumps({"text": f"document number {i} " * (i % 5 + 1)}) for i in range(40)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    common = ["--input", str(tmp_path / "in.jsonl"), "--append-eod", *sp_flags(model)]
    assert preprocess_data.main([*common, "--output-prefix", str(tmp_path / "one")]) == 0
    # Megatron's --keep-sequential-samples: contiguous partitions, merged back in input order.
    assert preprocess_data.main([*common, "--output-prefix", str(tmp_path / "parts"), "--partitions", "3",
                                 "--workers", "3", "--keep-sequential-samples"]) == 0
    # Megatron's default: lines dealt round-robin, so partition 0 holds lines 0, 2, 4, ...
    assert preprocess_data.main([*common, "--output-prefix", str(tmp_path / "rr"), "--partitions", "2",
                                 "--workers", "2"]) == 0
    dealt = lines[0::2] + lines[1::2]
    (tmp_path / "dealt.jsonl").write_text("\n".join(dealt) + "\n")
    assert preprocess_data.main(["--input", str(tmp_path / "dealt.jsonl"), "--append-eod", *sp_flags(model),
                                 "--output-prefix", str(tmp_path / "dealt")]) == 0
    assert not list(tmp_path.glob("parts_[0-9]*")) and not list(tmp_path.glob("rr_[0-9]*"))
    (tmp_path / "dir").mkdir()
    for name, part in (("a", lines[:15]), ("b", lines[15:])):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(part) + "\n")
        assert preprocess_data.main(["--input", str(tmp_path / f"{name}.jsonl"), "--append-eod",
                                     *sp_flags(model), "--output-prefix", str(tmp_path / "dir" / name)]) == 0
    merged = str(tmp_path / "m")
    assert merge_datasets.main(["--input", str(tmp_path / "dir"), "--output-prefix", merged]) == 0
    for ext in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{ext}").read_bytes()
        assert (tmp_path / f"parts_text_document{ext}").read_bytes() == one
        assert (tmp_path / f"m{ext}").read_bytes() == one
        assert (tmp_path / f"rr_text_document{ext}").read_bytes() == (
            tmp_path / f"dealt_text_document{ext}").read_bytes()


def test_partitions_run_at_the_same_time(tmp_path, english, monkeypatch):
    """Each partition is its own process: they overlap in time (Megatron runs them in parallel)."""
    from megafab.data.preprocess import pipeline

    *_, model = english
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(20)))
    spans = tmp_path / "spans"
    spans.mkdir()
    real = pipeline.run_local

    def timed(plan, select=None, prefix=None, describe=""):
        import os
        import time

        start = time.time()
        time.sleep(0.5)
        summary = real(plan, select, prefix, describe)
        (spans / str(os.getpid())).write_text(f"{start} {time.time()}")
        return summary

    monkeypatch.setattr(pipeline, "run_local", timed)
    assert preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), *sp_flags(model), "--partitions", "2",
                                 "--workers", "2", "--output-prefix", str(tmp_path / "o")]) == 0
    (a0, a1), (b0, b1) = [map(float, p.read_text().split()) for p in spans.iterdir()]
    assert max(a0, b0) < min(a1, b1)  # the two partitions overlapped


def test_cleaning_flags_report_removals(tmp_path, english, capsys):
    *_, model = english
    records = [
        {"text": "<p>Hello <b>world</b></p><script>x()</script>"},
        {"text": "<p>Hello <b>world</b></p>"},
        {"text": "tiny"},
        {"text": "A longer document that stays."},
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert (
        preprocess_data.main(
            [
                "--input",
                str(tmp_path / "in.jsonl"),
                "--output-prefix",
                str(tmp_path / "c"),
                "--strip-html",
                "--dedup",
                "--min-chars",
                "8",
                *sp_flags(model),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"removed short\s+1\s+4\s", out) and re.search(r"removed duplicate\s+1\s+25\s", out), out
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    ds = IndexedDataset(str(tmp_path / "c_text_document"))
    assert [tokenizer.detokenize(ds.document(i)) for i in range(2)] == ["Hello world", records[3]["text"]]


def run_tool(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "content,extra,message",
    [
        ('{"text": "ok"}\n{"text": broken\n', [], r"in.jsonl:2: malformed JSON"),
        ("", [], r"no documents to write"),
        ('{"body": "x"}\n', [], r"in.jsonl:1: no string .*field 'text'"),
        ('{"text": "x"}\n', ["--split-sentences"], r"--split-sentences needs an offline sentence splitter"),
    ],
)
def test_bad_input_returns_2_with_one_line(tmp_path, english, capsys, content, extra, message):
    *_, model = english
    (tmp_path / "in.jsonl").write_text(content)
    args = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"), *sp_flags(model)]
    assert preprocess_data.main(args + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("megafab: error: ") and err.count("\n") == 1 and re.search(message, err), err


def test_tool_process_exits_2_without_traceback(tmp_path, english):
    *_, model = english
    (tmp_path / "in.jsonl").write_text('{"text": "ok"}\nnot json\n')
    result = run_tool(
        str(REPO / "tools" / "preprocess_data.py"),
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output-prefix",
        str(tmp_path / "o"),
        *sp_flags(model),
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "in.jsonl:2: malformed JSON" in result.stderr


def test_skip_bad_lines_counts_them(tmp_path, english, capsys):
    *_, model = english
    (tmp_path / "in.jsonl").write_text('{"text": "good one"}\nnot json\n{"text": "good two"}\n')
    assert (
        preprocess_data.main(
            [
                "--input",
                str(tmp_path / "in.jsonl"),
                "--output-prefix",
                str(tmp_path / "o"),
                "--skip-bad-lines",
                *sp_flags(model),
            ]
        )
        == 0
    )
    assert re.search(r"removed bad\s+1\s", capsys.readouterr().out)
    assert IndexedDataset(str(tmp_path / "o_text_document")).num_documents == 2


def test_merge_tool_reports_broken_dataset(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.idx").write_bytes(b"garbage!!")
    (tmp_path / "d" / "x.bin").write_bytes(b"")
    assert merge_datasets.main(["--input", str(tmp_path / "d"), "--output-prefix", str(tmp_path / "m")]) == 2
    assert "x.idx: wrong magic" in capsys.readouterr().err
