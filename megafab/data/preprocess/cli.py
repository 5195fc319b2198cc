"""preprocess_data: jsonl (.gz, .zst), parquet or a HuggingFace save_to_disk directory -> Megatron .bin/.idx.

    python tools/preprocess_data.py --input 'data/*.jsonl' --output-prefix data/english \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --append-eod --workers 2
    -> data/english_text_document.bin / .idx  (one dataset per --json-keys key)

Byte-identical to Megatron-LM's tools/preprocess_data.py (see megafab/data/preprocess/blocks.py and
encoders.py for what that means case by case). Document order is preserved. Opt-in cleaning:
--strip-html, --min-chars N, --quality-filter, --filter-lang CODE, --dedup, --near-dedup [JACCARD],
with a report of the documents and bytes each rule removed. --ray ADDRESS runs the same pipeline on
a Ray cluster ('local' starts one on this machine with --workers CPUs).
"""

from __future__ import annotations

import argparse
import os
import sys

from megafab.data.errors import DataError
from megafab.data.preprocess.blocks import DEFAULT_BLOCK_BYTES, WorkerContext
from megafab.data.preprocess.cleaning import (
    HTML_EXTRACTORS,
    CleaningOptions,
    check_language_code,
    resolve_html_extractor,
)
from megafab.data.preprocess.dedup import bands_for
from megafab.data.preprocess.encoders import ENGINES, TokenizerSpec, build_encoder
from megafab.data.preprocess.pipeline import (
    Plan,
    Summary,
    output_prefix_for,
    remove_outputs,
    run_local,
    run_partitions,
)
from megafab.data.preprocess.ray_pipeline import run_ray
from megafab.data.readers import find_inputs
from megafab.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megafab.run.report import exit_status

# Megatron flags this tool does not implement: refused by name, never ignored.
REFUSED = {
    "--find-optimal-num-workers": "time a few --workers values yourself (benchmarks/data_throughput.py)",
    "--workers-to-check": "it belongs to --find-optimal-num-workers",
    "--max-documents": "it belongs to --find-optimal-num-workers",
    "--special-tokens": "add special tokens to the tokenizer files themselves",
    "--vocab-extra-ids": "add the extra ids to the tokenizer files themselves",
    "--tokenizer-hf-no-include-special-tokens": "megafab encodes as Megatron's default does",
    "--tokenizer-hf-no-use-fast": "megafab always uses the fast (tokenizers) implementation",
    "--trust-remote-code": "megafab loads local tokenizer files only",
    "--tokenizer-sentencepiece-legacy": "megafab encodes as Megatron's default (non-legacy) does",
    "--metadata-path": "pass --tokenizer-type and the tokenizer files",
    "--tiktoken-pattern": "TikTokenizer is not supported; convert it to a tokenizer.json",
    "--chat-template": "preprocessing pretraining text applies no chat template",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = parser.add_argument_group("input data")
    group.add_argument(
        "--input",
        required=True,
        help="jsonl / jsonl.gz / jsonl.zst / parquet file, a glob of them, or a save_to_disk dir",
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="JSON fields, or parquet / dataset columns, to tokenize (a string or a list of strings)",
    )
    group.add_argument(
        "--hf-split", default=None, help="split of a saved DatasetDict to read (default: train, with a note)"
    )
    group.add_argument(
        "--split-sentences",
        action="store_true",
        help="refused: needs NLTK's punkt model, which megafab does not ship",
    )
    group.add_argument(
        "--keep-newlines", action="store_true", help="as Megatron: only with --split-sentences"
    )
    group.add_argument(
        "--lang",
        default="english",
        help="Megatron's NLTK sentence-splitter language (only with --split-sentences); to keep "
        "documents of one language use --filter-lang",
    )
    group.add_argument("--skip-bad-lines", action="store_true", help="count and skip malformed lines")
    group = parser.add_argument_group("cleaning (opt-in; a report of documents and bytes removed per rule)")
    group.add_argument("--strip-html", action="store_true", help="reduce HTML markup to its text")
    group.add_argument(
        "--html-extractor",
        default="auto",
        choices=HTML_EXTRACTORS,
        help="auto: resiliparse when installed, else the standard library's parser",
    )
    group.add_argument("--min-chars", type=int, default=0, help="drop documents shorter than this")
    group.add_argument(
        "--quality-filter",
        action="store_true",
        help="Gopher rules: >= 50 words, mean word length 3-10, few '#'/'...', 80%% alphabetic words",
    )
    group.add_argument(
        "--filter-lang",
        default=None,
        metavar="CODE",
        help="keep only documents fastText's bundled lid.176 model identifies as CODE (e.g. en)",
    )
    group.add_argument("--dedup", action="store_true", help="drop exact duplicates (the first copy stays)")
    group.add_argument(
        "--near-dedup",
        type=float,
        nargs="?",
        const=0.7,
        default=None,
        metavar="JACCARD",
        help="drop near duplicates: MinHash LSH over word 5-grams (default Jaccard 0.7)",
    )
    group.add_argument(
        "--cleaning-report", default=None, metavar="PATH", help="also write the report as JSON"
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES,
                       help="the tokenizer training will use (Megatron's names)")
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (GPT2BPETokenizer)")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (GPT2BPETokenizer)")
    group.add_argument("--tokenizer-model", default=None,
                       help="SentencePiece .model, or a HuggingFace tokenizer.json / directory")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="vocabulary size of NullTokenizer (ids are read from the text)")
    group.add_argument("--append-eod", action="store_true",
                       help="end every document with the tokenizer's end-of-document token")
    group.add_argument(
        "--tokenizer-engine",
        default="auto",
        choices=ENGINES,
        help="auto: gigatoken when installed and exact on the probe texts, else the reference",
    )
    group.add_argument(
        "--use-gigatoken", action="store_true", help="Megatron's flag: --tokenizer-engine gigatoken"
    )
    group.add_argument(
        "--special-tokens-as-text",
        action="store_true",
        help="encode special-token strings found in the text ('<|endoftext|>') as plain text; "
        "Megatron turns them into the special tokens",
    )
    group = parser.add_argument_group("output and runtime")
    group.add_argument("--output-prefix", required=True,
                       help="writes PREFIX_<json key>_document.bin/.idx (PREFIX_text_document by default)")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    group.add_argument("--partitions", type=int, default=1,
                       help="split the input into this many parts, each with workers/partitions "
                            "processes, merged at the end (default: 1)")
    group.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="with --partitions: contiguous ranges of lines instead of round-robin (Megatron)",
    )
    group.add_argument("--log-interval", type=int, default=1000,
                       help="print progress every this many documents (default: 1000)")
    group.add_argument(
        "--block-mb",
        type=float,
        default=DEFAULT_BLOCK_BYTES / (1 << 20),
        help="input read per block of work; memory is about 3 x workers blocks",
    )
    group.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run on a Ray cluster (address, 'auto', or 'local' for --workers CPUs here)",
    )
    group.add_argument(
        "--ray-parts-dir", default=None, help="per-block outputs (default: OUTPUT_PREFIX_parts)"
    )
    for flag in REFUSED:
        parser.add_argument(flag, nargs="*", default=None, help=argparse.SUPPRESS)
    return parser


def _refuse_megatron_flags(args) -> None:
    for flag, fix in REFUSED.items():
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise DataError(
                f"{flag}: Megatron's preprocess_data.py flag is not implemented by megafab ({fix})"
            )


def check_args(args) -> None:
    _refuse_megatron_flags(args)
    if args.split_sentences:
        raise DataError(
            "--split-sentences needs an offline sentence splitter (nltk with its punkt model), "
            "which megafab does not ship; preprocess without it"
        )
    if args.lang != "english":
        raise DataError(
            f"--lang {args.lang}: this is Megatron's sentence-splitter language, used only with "
            f"--split-sentences; to keep only documents in a language pass --filter-lang {args.lang}"
        )
    if args.workers < 1 or args.partitions < 1 or args.log_interval < 1 or args.block_mb <= 0:
        raise DataError("--workers, --partitions and --log-interval must be at least 1, --block-mb above 0")
    if args.min_chars < 0:
        raise DataError(f"--min-chars {args.min_chars}: must be 0 or more")
    if args.ray is not None and args.partitions > 1:
        raise DataError("--ray and --partitions: Ray splits the work itself; drop --partitions")
    if args.use_gigatoken:
        args.tokenizer_engine = "gigatoken"


def make_plan(args) -> Plan:
    check_args(args)
    cleaning = CleaningOptions(
        strip_html=args.strip_html,
        html_extractor=args.html_extractor,
        min_chars=args.min_chars,
        quality=args.quality_filter,
        lang=args.filter_lang,
        dedup=args.dedup,
        near_dedup=args.near_dedup,
    )
    if cleaning.near_dedup is not None:
        bands_for(cleaning.near_dedup)
    if args.filter_lang:
        check_language_code(args.filter_lang)
    html_extractor = resolve_html_extractor(args.html_extractor) if args.strip_html else "builtin"
    tokenizer = build_tokenizer(
        args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model, args.vocab_size
    )
    spec = TokenizerSpec(
        args.tokenizer_type,
        args.vocab_file,
        args.merge_file,
        args.tokenizer_model,
        args.vocab_size,
        args.special_tokens_as_text,
        args.tokenizer_engine,
    )
    encoder = build_encoder(spec, tokenizer.vocab_size, tokenizer.eod)
    engine = "gigatoken" if encoder.name == "gigatoken" else "reference"
    spec = TokenizerSpec(**{**spec.__dict__, "engine": engine})  # workers skip the probe's fallback note
    sources = tuple(find_inputs(args.input, args.json_keys, args.hf_split))
    context = WorkerContext(
        spec,
        tokenizer.vocab_size,
        tokenizer.eod,
        tuple(args.json_keys),
        args.append_eod,
        cleaning,
        html_extractor,
    )
    out_dir = os.path.dirname(args.output_prefix)
    if out_dir:
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise DataError(
                f"--output-prefix {args.output_prefix}: cannot create {out_dir} ({e.strerror})"
            ) from None
    return Plan(
        sources,
        context,
        args.output_prefix,
        args.workers,
        int(args.block_mb * (1 << 20)),
        args.skip_bad_lines,
        args.log_interval,
        engine_name=encoder.name,
    )


def run(args) -> int:
    plan = make_plan(args)
    if args.ray is not None:
        summary = run_ray(plan, args.ray, args.ray_parts_dir)
    elif args.partitions > 1:
        summary = run_partitions(plan, args.partitions, args.keep_sequential_samples)
    else:
        summary = run_local(plan)
    report_summary(args, plan, summary)
    return 0


def report_summary(args, plan: Plan, summary: Summary) -> None:
    outputs = [output_prefix_for(args.output_prefix, key) for key in args.json_keys]
    if summary.documents == 0:
        remove_outputs(args.output_prefix, args.json_keys)
        raise DataError(
            f"--input {args.input}: no documents to write (empty input, or every document was "
            "removed by the cleaning flags or --skip-bad-lines)"
        )
    for line in summary.report.lines():
        print(line)
    if args.cleaning_report:
        summary.report.write_json(args.cleaning_report)
    seconds = max(summary.seconds, 1e-9)
    print(
        f"done: {summary.documents} documents, {summary.bytes / 1e6:.2f} MB, {summary.tokens} tokens in "
        f"{seconds:.2f} s ({summary.documents / seconds:.0f} docs/s, "
        f"{summary.bytes / seconds / 1e6:.2f} MB/s, "
        f"{plan.engine_name}) -> {', '.join(outputs)}"
    )


def main(argv=None) -> int:
    """The tool: 0 on success; a user error prints one `megafab: error:` line and returns 2."""
    return exit_status(lambda: run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
