"""Data pipeline speed: preprocess_data.py stage by stage and end to end (megafab --workers 1 / 2,
Megatron-LM's preprocess_data_fast.py where its source is given, the Ray pipeline on 2 CPUs),
GPTDataset index build for a synthetic 1B-token dataset, and data loader samples/s.

    python benchmarks/data_throughput.py [--repeat 8] [--megatron-lm /path/to/Megatron-LM] [--ray]

Steps (everything in a temporary directory):
  1. tools/corpus.py builds the English quick-start corpus (train + valid), repeated --repeat times
     (8: 76 MB, 15,752 documents); a GPT-2 byte-level BPE (vocab 8192, vocab.json + merges.txt) is
     trained on it with tokenizers (untimed).
  2. Stages, in this process on one core: read (raw lines), parse (UTF-8 + JSON), tokenize (the
     engine the tool picks), write (.bin/.idx): docs/s and MB/s of each.
  3. End to end, interleaved --rounds times: megafab --workers 1, --workers 2, Megatron's
     preprocess_data_fast.py (gigatoken, all cores), each a fresh process: wall seconds, and the
     tool's own timing of its work (steady state: megafab's "done: ... in S s", Megatron's
     "Elapsed time", both after imports). Outputs are compared byte for byte.
  4. --ray: the same corpus through --ray local --workers 2 vs --workers 2 (Ray start-up included).
  5. GPTDataset over synthetic document lengths totalling --index-tokens tokens: index build time.
  6. build_data_iterator over the preprocessed corpus: samples/s with 0 and 2 loader workers.
Megatron-LM needs Python >= 3.12 for typing.override (patched in from typing_extensions here) and
the hub for GPT2BPETokenizer: it runs from a folder holding ./gpt2/ made of the trained files.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_util import load_average  # noqa: E402
from megafab.data.gpt_dataset import GPTDataset  # noqa: E402
from megafab.data.indexed_dataset import IndexedDataset  # noqa: E402
from megafab.data.samplers import build_data_iterator  # noqa: E402


def run_tool(*args, cwd=ROOT, env=None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, check=True, capture_output=True, text=True, env=env
    )
    return time.perf_counter() - start, done.stdout + done.stderr


def gpt2_flags(tmp: str) -> list[str]:
    return [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        os.path.join(tmp, "vocab.json"),
        "--merge-file",
        os.path.join(tmp, "merges.txt"),
    ]


def corpus(tmp: str, repeat: int, max_docs: int | None) -> tuple[str, int, int]:
    """The quick-start corpus repeated, and a GPT-2 BPE (vocab 8192) trained on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    run_tool("tools/corpus.py", "--output-dir", tmp)
    lines = []
    for name in ("english_train.jsonl", "english_valid.jsonl"):
        with open(os.path.join(tmp, name)) as f:
            lines += f.readlines()
    lines = lines[:max_docs] if max_docs else lines
    jsonl = os.path.join(tmp, "corpus.jsonl")
    with open(jsonl, "w") as f:
        f.writelines(lines * repeat)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        (json.loads(line)["text"] for line in lines),
        trainers.BpeTrainer(
            vocab_size=8192,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.model.save(tmp)
    return jsonl, len(lines) * repeat, os.path.getsize(jsonl)


def stage_table(tmp: str, jsonl: str, docs: int, size: int) -> None:
    from megafab.data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab
    from megafab.data.preprocess.encoders import TokenizerSpec, build_encoder
    from megafab.data.readers import jsonl_lines
    from megafab.data.tokenizers import build_tokenizer

    vocab, merges = gpt2_flags(tmp)[3], gpt2_flags(tmp)[5]
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    rows = []
    start = time.perf_counter()
    raw = [line for _, line, _ in jsonl_lines(jsonl)]
    rows.append(("read (raw lines)", time.perf_counter() - start))
    start = time.perf_counter()
    texts = [json.loads(line.decode("utf-8"))["text"] for line in raw]
    rows.append(("parse (UTF-8 + JSON)", time.perf_counter() - start))
    engines = {}
    for engine in ("gigatoken", "reference"):
        encoder = build_encoder(
            TokenizerSpec("GPT2BPETokenizer", vocab, merges, engine=engine),
            tokenizer.vocab_size,
            tokenizer.eod,
        )
        sample = texts if engine == "gigatoken" else texts[: max(1, len(texts) // 8)]
        start = time.perf_counter()
        engines[engine] = encoder.encode(sample)
        seconds = (time.perf_counter() - start) * len(texts) / len(sample)
        rows.append((f"tokenize ({encoder.name}, 1 core)", seconds))
    ids = engines["gigatoken"]
    start = time.perf_counter()
    writer = IndexedDatasetWriter(os.path.join(tmp, "stage.bin"), dtype_for_vocab(tokenizer.vocab_size))
    lengths = np.array([len(x) for x in ids])
    writer.add_packed(np.concatenate(ids), lengths, np.ones(len(ids), dtype=np.int64))
    writer.finalize(os.path.join(tmp, "stage.idx"))
    rows.append(("write (.bin/.idx)", time.perf_counter() - start))
    print(
        f"\npreprocess stages, in one process on one core: {docs} documents, {size / 1e6:.1f} MB jsonl "
        "(reference tokenizer timed on 1/8 of the corpus and scaled)"
    )
    print(f"{'stage':<32}{'s':>8}{'docs/s':>10}{'MB/s':>9}")
    for name, seconds in rows:
        print(f"{name:<32}{seconds:>8.2f}{docs / seconds:>10.0f}{size / 1e6 / seconds:>9.1f}")


def steady_seconds(output: str) -> float:
    """The tool's own timing of its work: megafab's 'done: ... in S s', Megatron's 'Elapsed time: S'."""
    found = re.search(r"tokens in ([\d.]+) s", output) or re.search(r"Elapsed time: ([\d.]+) seconds", output)
    return float(found.group(1))


def megatron_fast(megatron: str, tmp: str, jsonl: str, prefix: str) -> tuple[float, str]:
    home = os.path.join(tmp, "megatron_home")
    os.makedirs(os.path.join(home, "gpt2"), exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(os.path.join(tmp, name), os.path.join(home, "gpt2", name))
    for name, text in (("config.json", '{"model_type": "gpt2"}'), ("tokenizer_config.json", "{}")):
        with open(os.path.join(home, "gpt2", name), "w") as f:
            f.write(text)
    runner = (
        "import runpy, sys, typing, typing_extensions; typing.override = typing_extensions.override; "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    env = {**os.environ, "PYTHONPATH": megatron, "HF_HUB_OFFLINE": "1"}
    return run_tool(
        "-c",
        runner,
        os.path.join(megatron, "tools", "preprocess_data_fast.py"),
        "--input",
        jsonl,
        "--output-prefix",
        prefix,
        *gpt2_flags(tmp),
        "--append-eod",
        "--use-gigatoken",
        cwd=home,
        env=env,
    )


def same_outputs(a: str, b: str) -> bool:
    return all(
        filecmp.cmp(f"{a}_text_document{ext}", f"{b}_text_document{ext}", shallow=False)
        for ext in (".bin", ".idx")
    )


def preprocess_table(args, tmp: str) -> str:
    jsonl, docs, size = corpus(tmp, args.repeat, args.max_docs)
    stage_table(tmp, jsonl, docs, size)
    one_doc = os.path.join(tmp, "one.jsonl")
    with open(jsonl) as f, open(one_doc, "w") as out:
        out.write(f.readline())
    tools = {"1 megafab": ["--workers", "1"], "2 megafab": ["--workers", "2"]}
    if args.megatron_lm:
        tools["2 megatron-fast"] = None
    walls, steady = {t: [] for t in tools}, {t: [] for t in tools}
    startup = []
    for _ in range(args.rounds):
        for name, extra in tools.items():
            prefix = os.path.join(tmp, name.replace(" ", "_"))
            if extra is None:
                wall, out = megatron_fast(args.megatron_lm, tmp, jsonl, prefix)
            else:
                wall, out = run_tool(
                    "tools/preprocess_data.py",
                    "--input",
                    jsonl,
                    "--output-prefix",
                    prefix,
                    *gpt2_flags(tmp),
                    "--append-eod",
                    *extra,
                )
            walls[name].append(wall)
            steady[name].append(steady_seconds(out))
        startup.append(
            run_tool(
                "tools/preprocess_data.py",
                "--input",
                one_doc,
                "--output-prefix",
                os.path.join(tmp, "one"),
                *gpt2_flags(tmp),
                "--append-eod",
            )[0]
        )
    first = os.path.join(tmp, "1_megafab")
    print(
        f"\npreprocess_data.py end to end, GPT-2 BPE vocab 8192: {docs} documents, "
        f"{size / 1e6:.1f} MB jsonl, "
        f"{args.rounds} interleaved rounds (median); megafab start-up on a one-document file "
        f"{statistics.median(startup):.2f} s; {load_average()}"
    )
    print(
        f"{'workers tool':<20}{'wall s':>8}{'docs/s':>9}{'steady s':>10}{'docs/s':>9}{'MB/s':>7}"
        f"{'  same bytes as --workers 1'}"
    )
    for name in tools:
        wall, work = statistics.median(walls[name]), statistics.median(steady[name])
        same = same_outputs(os.path.join(tmp, name.replace(" ", "_")), first)
        print(
            f"{name:<20}{wall:>8.2f}{docs / wall:>9.0f}{work:>10.2f}{docs / work:>9.0f}"
            f"{size / 1e6 / work:>7.1f}"
            f"  {same}"
        )
    ratios = [a / b for a, b in zip(steady["1 megafab"], steady["2 megafab"])]
    print(
        f"--workers 2 / --workers 1 steady-state speed-up per round: {', '.join(f'{r:.2f}' for r in ratios)}"
    )
    if args.ray:
        wall_local, _ = run_tool(
            "tools/preprocess_data.py",
            "--input",
            jsonl,
            "--output-prefix",
            os.path.join(tmp, "local2"),
            *gpt2_flags(tmp),
            "--append-eod",
            "--workers",
            "2",
        )
        wall_ray, out = run_tool(
            "tools/preprocess_data.py",
            "--input",
            jsonl,
            "--output-prefix",
            os.path.join(tmp, "ray2"),
            *gpt2_flags(tmp),
            "--append-eod",
            "--workers",
            "2",
            "--ray",
            "local",
        )
        print(
            f"\nRay pipeline, local 2-CPU cluster vs the single-machine tool, same corpus; {load_average()}"
        )
        print(f"{'pipeline':<26}{'wall s':>8}{'docs/s':>9}{'steady s':>10}  same bytes")
        print(f"{'--workers 2':<26}{wall_local:>8.2f}{docs / wall_local:>9.0f}")
        same = same_outputs(os.path.join(tmp, "ray2"), os.path.join(tmp, "local2"))
        print(
            f"{'--ray local --workers 2':<26}{wall_ray:>8.2f}{docs / wall_ray:>9.0f}"
            f"{steady_seconds(out):>10.2f}"
            f"  {same}"
        )
    return first + "_text_document"


def index_table(args) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4096, size=int(args.index_tokens / 2048 * 1.05) + 1, dtype=np.int32)
    cut = int(np.searchsorted(np.cumsum(lengths, dtype=np.int64), args.index_tokens)) + 1
    lengths = lengths[:cut]
    indexed = SimpleNamespace(sequence_lengths=lengths)
    tokens = int(lengths.sum(dtype=np.int64))
    samples = (tokens - 1) // args.seq
    start = time.perf_counter()
    dataset = GPTDataset(
        indexed, None, np.arange(len(lengths), dtype=np.int32), samples, "train", args.seq, seed=1234, eod=0
    )
    seconds = time.perf_counter() - start
    print(
        f"\nGPTDataset index build, no cache: {tokens / 1e9:.3f}B tokens in {len(lengths)} documents, "
        f"seq {args.seq}"
    )
    print(f"{'samples':>10}{'build s':>10}{'Mtokens/s':>11}")
    print(f"{len(dataset):>10}{seconds:>10.2f}{tokens / seconds / 1e6:>11.0f}")


def loader_table(args, prefix: str) -> None:
    seq, mbs = max(args.seq // 8, 16), 8
    indexed = IndexedDataset(prefix)
    tokens = int(np.asarray(indexed.sequence_lengths).sum())
    dataset = GPTDataset(
        indexed,
        prefix,
        np.arange(len(indexed), dtype=np.int32),
        args.loader_samples,
        "train",
        seq,
        seed=1234,
        eod=0,
    )
    print(
        f"\nData loader (build_data_iterator, GPTDataset over the preprocessed corpus, {tokens} tokens): "
        f"seq {seq}, micro-batch {mbs}, {args.loader_samples} samples"
    )
    print(f"{'workers':<9}{'samples/s':>11}{'first batch s':>15}")
    for workers in (0, 2):
        start = time.perf_counter()
        it = build_data_iterator(dataset, 0, mbs, 0, 1, num_workers=workers)
        next(it)
        first = time.perf_counter() - start
        start = time.perf_counter()
        seen = 0
        for batch in it:
            seen += batch["tokens"].shape[0]
        print(f"{workers:<9}{seen / (time.perf_counter() - start):>11.0f}{first:>15.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index-tokens", type=int, default=1_000_000_000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--loader-samples", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-docs", type=int, default=None, help="use only the first N corpus documents")
    ap.add_argument("--repeat", type=int, default=8, help="repeat the quick-start corpus this many times")
    ap.add_argument(
        "--megatron-lm",
        default=os.environ.get("MEGATRON_LM"),
        help="a Megatron-LM source tree: adds its tools/preprocess_data_fast.py to the table",
    )
    ap.add_argument("--ray", action="store_true", help="also time the Ray pipeline on a local 2-CPU cluster")
    args = ap.parse_args(argv)
    print(f"Data throughput; {load_average()}")
    with tempfile.TemporaryDirectory(prefix="megafab_data_bench_") as tmp:
        prefix = preprocess_table(args, tmp)
        index_table(args)
        loader_table(args, prefix)
    print(f"\nafter: {load_average()}")


if __name__ == "__main__":
    main()
