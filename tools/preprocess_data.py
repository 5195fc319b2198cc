"""Tokenize jsonl (or .jsonl.gz, parquet, a HuggingFace save_to_disk directory) into Megatron .bin/.idx.

    python tools/preprocess_data.py --input 'data/*.jsonl' --output-prefix data/english \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/english.model \\
        --append-eod --workers 2
    -> data/english_text_document.bin / .idx  (one dataset per --json-keys key)

Document order is preserved. Opt-in cleaning: --strip-html, --dedup, --min-chars N, --lang CODE.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from html.parser import HTMLParser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megafab.data.errors import DataError  # noqa: E402
from megafab.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetWriter,
    data_file_path,
    dtype_for_vocab,
    index_file_path,
    merge_datasets,
)
from megafab.data.readers import find_inputs, read_records, require  # noqa: E402
from megafab.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402


class PreprocessError(Exception):
    pass


class _TextOnly(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("p", "br", "div", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def strip_html(text: str) -> str:
    parser = _TextOnly()
    parser.feed(text)
    parser.close()
    return "".join(parser.parts).strip()


# ---- workers -------------------------------------------------------------------------------------

_worker = {}


def init_worker(tokenizer_args: dict, keys: list[str], options: dict) -> None:
    _worker["tokenizer"] = build_tokenizer(**tokenizer_args)
    if options["lang"]:
        seed_language_detector()
    _worker["keys"] = keys
    _worker["options"] = options


def encode(item: tuple[str, int, str | dict]):
    """-> ("ok", {key: ids}, bytes, digest) | ("drop", reason) | ("bad", message)."""
    path, number, raw = item
    keys, options, tokenizer = _worker["keys"], _worker["options"], _worker["tokenizer"]
    if isinstance(raw, str):
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            return "bad", f"{path}:{number}: malformed JSON ({e.msg} at column {e.colno})"
    else:
        record = raw
    if not isinstance(record, dict):
        return "bad", f"{path}:{number}: expected a JSON object, got {type(record).__name__}"
    texts = {}
    for key in keys:
        if not isinstance(record.get(key), str):
            return "bad", f"{path}:{number}: no string field {key!r} (--json-keys {' '.join(keys)})"
        text = record[key]
        if options["strip_html"]:
            text = strip_html(text)
        texts[key] = text
    joined = "\n".join(texts.values())
    if len(joined) < options["min_chars"]:
        return "drop", "short"
    if options["lang"] and not _language_ok(joined, options["lang"]):
        return "drop", "language"
    ids = {}
    for key, text in texts.items():
        tokens = tokenizer.tokenize(text)
        if options["append_eod"]:
            tokens.append(tokenizer.eod)
        ids[key] = tokens
    digest = hashlib.sha1(joined.encode("utf-8")).digest() if options["dedup"] else None
    return "ok", ids, len(joined.encode("utf-8")), digest


LANGDETECT_SEED = 0


def check_language_code(lang: str) -> None:
    """Fail early when --lang cannot work: langdetect missing, or a code it never returns."""
    require("langdetect", f"--lang {lang} (offline language detection)", "langdetect")
    from langdetect.detector_factory import PROFILES_DIRECTORY, init_factory

    codes = os.listdir(PROFILES_DIRECTORY)
    if lang not in codes:
        raise PreprocessError(f"--lang {lang}: langdetect knows the codes {', '.join(sorted(codes))}; "
                              "pass one of them, e.g. --lang en")
    init_factory()  # load the language profiles once, before the worker pool forks


def seed_language_detector() -> None:
    # langdetect samples n-grams at random; a fixed seed makes every run keep the same documents.
    from langdetect import DetectorFactory

    DetectorFactory.seed = LANGDETECT_SEED


def _language_ok(text: str, lang: str) -> bool:
    from langdetect import detect
    from langdetect.lang_detect_exception import LangDetectException

    try:
        return detect(text[:2000]) == lang
    except LangDetectException:  # no letters at all: no language to keep
        return False


# ---- driver --------------------------------------------------------------------------------------

def output_prefix_for(prefix: str, key: str, sentences: bool) -> str:
    return f"{prefix}_{key}_{'sentence' if sentences else 'document'}"


def process(args, items: Iterator[tuple[str, int, str | dict]], prefix: str, vocab_size: int) -> dict:
    """Tokenize items in order into one dataset per key under prefix; returns counters."""
    dtype = dtype_for_vocab(vocab_size)
    writers = {key: IndexedDatasetWriter(data_file_path(output_prefix_for(prefix, key, False)), dtype)
               for key in args.json_keys}
    options = dict(strip_html=args.strip_html, min_chars=args.min_chars, lang=args.lang,
                   append_eod=args.append_eod, dedup=args.dedup)
    tokenizer_args = dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                          merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                          vocab_size=args.vocab_size)
    counts = {"documents": 0, "bytes": 0, "bad": 0, "short": 0, "language": 0, "duplicate": 0}
    seen: set[bytes] = set()
    start = time.time()
    if args.workers > 1:
        pool = multiprocessing.get_context("fork").Pool(args.workers, init_worker,
                                                        (tokenizer_args, args.json_keys, options))
        results = pool.imap(encode, items, chunksize=64)
    else:
        pool = None
        init_worker(tokenizer_args, args.json_keys, options)
        results = map(encode, items)
    try:
        for result in results:
            if result[0] == "bad":
                if not args.skip_bad_lines:
                    raise PreprocessError(result[1] + "; fix the line or pass --skip-bad-lines")
                counts["bad"] += 1
                continue
            if result[0] == "drop":
                counts[result[1]] += 1
                continue
            _, ids, nbytes, digest = result
            if digest is not None:
                if digest in seen:
                    counts["duplicate"] += 1
                    continue
                seen.add(digest)
            for key, tokens in ids.items():
                writers[key].add_document(tokens)
            counts["documents"] += 1
            counts["bytes"] += nbytes
            if counts["documents"] % args.log_interval == 0:
                elapsed, n = max(time.time() - start, 1e-9), counts["documents"]
                print(f"processed {n} documents ({n / elapsed:.0f} docs/s, "
                      f"{counts['bytes'] / elapsed / 1e6:.2f} MB/s)", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.terminate()
    for key, writer in writers.items():
        writer.finalize(index_file_path(output_prefix_for(prefix, key, False)))
    counts["seconds"] = time.time() - start
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True,
                       help="jsonl / jsonl.gz / parquet file, a glob of them, or a save_to_disk dir")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="JSON fields, or parquet / dataset columns, to tokenize")
    group.add_argument("--hf-split", default=None,
                       help="split of a saved DatasetDict to read (default: train, with a note)")
    group.add_argument("--split-sentences", action="store_true")
    group.add_argument("--keep-newlines", action="store_true")
    group.add_argument("--skip-bad-lines", action="store_true", help="count and skip malformed lines")
    group = parser.add_argument_group("cleaning (opt-in)")
    group.add_argument("--strip-html", action="store_true", help="reduce HTML markup to its text")
    group.add_argument("--dedup", action="store_true", help="drop exact duplicate documents")
    group.add_argument("--min-chars", type=int, default=0, help="drop documents shorter than this")
    group.add_argument("--lang", default=None,
                       help="keep only documents langdetect classifies as this code (e.g. en)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-model", default=None)
    group.add_argument("--vocab-size", type=int, default=None)
    group.add_argument("--append-eod", action="store_true")
    group = parser.add_argument_group("output and runtime")
    group.add_argument("--output-prefix", required=True)
    group.add_argument("--workers", type=int, default=1)
    group.add_argument("--partitions", type=int, default=1)
    group.add_argument("--log-interval", type=int, default=1000)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (PreprocessError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.split_sentences:
        raise PreprocessError("--split-sentences needs an offline sentence splitter (nltk with its punkt "
                              "model), which megafab does not ship; preprocess without it")
    if args.lang:
        check_language_code(args.lang)
    if args.workers < 1 or args.partitions < 1 or args.log_interval < 1:
        raise PreprocessError("--workers, --partitions and --log-interval must be at least 1")
    vocab_size = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                                 args.vocab_size).vocab_size
    sources = find_inputs(args.input, args.json_keys, args.hf_split)
    if os.path.dirname(args.output_prefix):
        os.makedirs(os.path.dirname(args.output_prefix), exist_ok=True)

    def items(selected=None):
        index = 0
        for source in sources:
            for number, raw in read_records(source, args.json_keys):
                if selected is None or selected[0] <= index < selected[1]:
                    yield source.path, number, raw
                index += 1

    if args.partitions == 1:
        counts = process(args, items(), args.output_prefix, vocab_size)
    else:
        total = sum(1 for _ in items())
        bounds = [total * p // args.partitions for p in range(args.partitions + 1)]
        parts = [f"{args.output_prefix}_partition{p}" for p in range(args.partitions)]
        counts = {}
        for p, part in enumerate(parts):
            c = process(args, items((bounds[p], bounds[p + 1])), part, vocab_size)
            counts = {k: counts.get(k, 0) + v for k, v in c.items()}
        for key in args.json_keys:
            names = [output_prefix_for(part, key, False) for part in parts]
            merge_datasets(names, output_prefix_for(args.output_prefix, key, False))
            for name in names:
                os.remove(data_file_path(name))
                os.remove(index_file_path(name))
    if counts["documents"] == 0:
        for key in args.json_keys:
            for path in (data_file_path(output_prefix_for(args.output_prefix, key, False)),
                         index_file_path(output_prefix_for(args.output_prefix, key, False))):
                os.remove(path)
        raise PreprocessError(f"--input {args.input}: no documents to write (empty input, or every "
                              "document was removed by the cleaning flags)")
    seconds = max(counts["seconds"], 1e-9)
    for reason in ("bad", "short", "language", "duplicate"):
        if counts[reason]:
            label = f"language not {args.lang}" if reason == "language" else reason
            print(f"removed {counts[reason]} documents ({label})")
    print(f"done: {counts['documents']} documents, {counts['bytes'] / 1e6:.2f} MB in {seconds:.2f} s "
          f"({counts['documents'] / seconds:.0f} docs/s, {counts['bytes'] / seconds / 1e6:.2f} MB/s) -> "
          + ", ".join(output_prefix_for(args.output_prefix, k, False) for k in args.json_keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
