"""Cleaning rules and their report on a corpus whose answers are known, and the Ray pipeline's parity."""

import json
import re
from pathlib import Path

import pytest

from megafab.data.preprocess import cli
from tests.helpers.preprocess import TOKENIZERS

FIXTURES = Path(__file__).parent / "fixtures"
GPT2 = TOKENIZERS["gpt2"]
CLEANING = [
    "--strip-html",
    "--min-chars",
    "20",
    "--quality-filter",
    "--filter-lang",
    "en",
    "--dedup",
    "--near-dedup",
    "0.7",
]

ENGLISH = (
    "The river runs quietly past the old mill and the children walk along its bank every morning "
    "while their parents talk about the weather, the harvest and the price of bread in the town. "
    "Scientists measured the temperature of the lake for ten years and found that it was slowly "
    "getting warmer, which changed the fish that live there and the birds that feed on them."
)
NEAR = ENGLISH.replace("children walk", "children run")
OTHER = (
    "Our train was late again so we bought coffee and read the newspaper while we were waiting on the "
    "platform. The committee will publish its report next week after reviewing all of the public "
    "comments, and he learned to cook from his grandmother, who never wrote down one of her recipes."
)
FRENCH = (
    "Le chat dort sur le canapé pendant que nous préparons le dîner avec les enfants ce soir, et la "
    "pluie tombe doucement sur le toit de la vieille maison au bord de la rivière. Les scientifiques "
    "ont mesuré la température du lac pendant dix ans et ont constaté qu'il se réchauffait lentement."
)
HTML = (f"<html><head><style>p {{color: red}}</style></head><body><p>{OTHER}</p>"
        "<script>x()</script></body></html>")
CASES = [  # (text, the rule that removes it or None)
    (ENGLISH, None),
    (ENGLISH, "duplicate"),
    (NEAR, "near_duplicate"),
    (FRENCH, "language"),
    (HTML, None),
    ("tiny", "short"),
    ("#tag " * 60, "quality:symbols"),
    (" ".join(str(100 + i) for i in range(60)), "quality:non_alpha"),
    ("Only ten words in this sentence, which is far too few.", "quality:few_words"),
]


def write_corpus(path):
    path.write_text(
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t, _ in CASES), encoding="utf-8"
    )
    return path


def expected_report():
    removed = {}
    for text, rule in CASES:
        if rule:
            entry = removed.setdefault(rule, {"documents": 0, "bytes": 0})
            entry["documents"] += 1
            entry["bytes"] += len(text.encode("utf-8"))
    return removed


def run(tmp_path, name, *extra):
    corpus = write_corpus(tmp_path / "mixed.jsonl")
    report = tmp_path / f"{name}.json"
    assert (
        cli.main(
            [
                "--input",
                str(corpus),
                "--output-prefix",
                str(tmp_path / name),
                "--append-eod",
                *GPT2,
                *CLEANING,
                "--cleaning-report",
                str(report),
                *extra,
            ]
        )
        == 0
    )
    return json.loads(report.read_text()), {
        ext: (tmp_path / f"{name}_text_document.{ext}").read_bytes() for ext in ("bin", "idx")
    }


def test_report_counts_documents_and_bytes_per_rule(tmp_path, capsys):
    report, _ = run(tmp_path, "local", "--workers", "2", "--block-mb", "0.0005")
    html = report["removed"].pop("html")
    assert report["removed"] == expected_report()
    kept_bytes = len(ENGLISH.encode()) + len(HTML.encode())
    assert report["kept"] == {"documents": 2, "bytes": kept_bytes}
    # The extractor removed the markup, the style and the script and kept OTHER's text exactly; it also
    # trimmed the trailing space of "#tag " * 60 (every document goes through it).
    assert html == {"documents": 0, "bytes": len(HTML) - len(OTHER) + 1}
    out = capsys.readouterr().out
    assert re.search(r"removed near_duplicate\s+1\s", out) and "done: 2 documents" in out


def test_cleaned_output_equals_preprocessing_the_survivors(tmp_path):
    _, cleaned = run(tmp_path, "c")
    (tmp_path / "survivors.jsonl").write_text(
        json.dumps({"text": ENGLISH}) + "\n" + json.dumps({"text": OTHER}) + "\n"
    )
    assert (
        cli.main(
            [
                "--input",
                str(tmp_path / "survivors.jsonl"),
                "--output-prefix",
                str(tmp_path / "s"),
                "--append-eod",
                *GPT2,
            ]
        )
        == 0
    )
    assert cleaned == {ext: (tmp_path / f"s_text_document.{ext}").read_bytes() for ext in ("bin", "idx")}


@pytest.mark.slow
def test_ray_pipeline_on_a_local_two_cpu_cluster_is_byte_identical(tmp_path):
    ray = pytest.importorskip("ray", reason="the ray[data] extra is not installed")
    local_report, local = run(tmp_path, "local")
    try:
        # Units of ~500 bytes: the corpus is cut into several units run by two actors.
        ray_report, on_ray = run(tmp_path, "ray", "--ray", "local", "--workers", "2", "--block-mb", "0.0005")
        assert ray.cluster_resources()["CPU"] == 2
    finally:
        ray.shutdown()
    assert ray_report == local_report and on_ray == local
    assert not (tmp_path / "ray_parts").exists()
