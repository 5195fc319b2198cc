"""Data pipeline speed: preprocess_data.py on the quick-start corpus with 1 and 2 workers, GPTDataset
index build for a synthetic 1B-token dataset, and data loader samples/s.

    python benchmarks/data_throughput.py [--index-tokens 1000000000 --seq 2048 --loader-samples 2000]

Steps (everything in a temporary directory):
  1. tools/corpus.py builds the English quick-start corpus (Shakespeare + KJV, installed packages);
     tools/train_tokenizer.py trains the quick start's SentencePiece model (vocab 4096, untimed).
  2. tools/preprocess_data.py (GPTSentencePieceTokenizer, --append-eod) with --workers 1 and 2, runs
     interleaved, `--rounds` each; wall time of the command, and the same minus the time the command
     takes on a one-document file (interpreter + tokenizer start-up), documents/s and input MB/s.
  3. GPTDataset over synthetic document lengths (uniform in [1, 4096)) totalling --index-tokens
     tokens, one epoch of seq --seq samples, no cache: time to build document/sample/shuffle index.
  4. build_data_iterator over the preprocessed corpus (GPTDataset, seq --seq / 8, micro-batch 8):
     samples/s with 0 and 2 loader workers.
"""

from __future__ import annotations

import argparse
import os
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


def run_tool(*args) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def preprocess(jsonl: str, model: str, prefix: str, workers: int) -> float:
    return run_tool("tools/preprocess_data.py", "--input", jsonl, "--output-prefix", prefix,
                    "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model,
                    "--append-eod", "--workers", str(workers))


def corpus(tmp: str, max_docs: int | None) -> tuple[str, str, int, int]:
    run_tool("tools/corpus.py", "--output-dir", tmp)
    jsonl = os.path.join(tmp, "english_train.jsonl")
    if max_docs:
        with open(jsonl) as f:
            lines = f.readlines()[:max_docs]
        with open(jsonl, "w") as f:
            f.writelines(lines)
    run_tool("tools/train_tokenizer.py", "--input", jsonl, "--output-prefix", os.path.join(tmp, "english"),
             "--vocab-size", "4096")
    with open(jsonl) as f:
        docs = sum(1 for line in f if line.strip())
    return jsonl, os.path.join(tmp, "english.model"), docs, os.path.getsize(jsonl)


def preprocess_table(args, tmp: str) -> str:
    jsonl, model, docs, size = corpus(tmp, args.max_docs)
    one_doc = os.path.join(tmp, "one.jsonl")
    with open(jsonl) as f, open(one_doc, "w") as out:
        out.write(f.readline())
    startup = {w: [] for w in (1, 2)}
    walls = {w: [] for w in (1, 2)}
    for _ in range(args.rounds):
        for workers in (1, 2):
            walls[workers].append(preprocess(jsonl, model, os.path.join(tmp, f"w{workers}"), workers))
            startup[workers].append(preprocess(one_doc, model, os.path.join(tmp, "one"), workers))
    print(f"\npreprocess_data.py, quick-start train split: {docs} documents, {size / 1e6:.2f} MB jsonl, "
          f"{args.rounds} interleaved rounds (median)")
    print(f"{'workers':<9}{'wall s':>9}{'start-up s':>12}{'docs/s':>10}{'MB/s':>8}"
          f"{'docs/s excl. start-up':>24}"
          f"{'MB/s excl.':>12}")
    for workers in (1, 2):
        wall, start = statistics.median(walls[workers]), statistics.median(startup[workers])
        work = max(wall - start, 1e-9)
        print(f"{workers:<9}{wall:>9.2f}{start:>12.2f}{docs / wall:>10.0f}{size / 1e6 / wall:>8.2f}"
              f"{docs / work:>24.0f}{size / 1e6 / work:>12.2f}")
    return os.path.join(tmp, "w2_text_document")


def index_table(args) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4096, size=int(args.index_tokens / 2048 * 1.05) + 1, dtype=np.int32)
    cut = int(np.searchsorted(np.cumsum(lengths, dtype=np.int64), args.index_tokens)) + 1
    lengths = lengths[:cut]
    indexed = SimpleNamespace(sequence_lengths=lengths)
    tokens = int(lengths.sum(dtype=np.int64))
    samples = (tokens - 1) // args.seq
    start = time.perf_counter()
    dataset = GPTDataset(indexed, None, np.arange(len(lengths), dtype=np.int32), samples, "train", args.seq,
                         seed=1234, eod=0)
    seconds = time.perf_counter() - start
    print(f"\nGPTDataset index build, no cache: {tokens / 1e9:.3f}B tokens in {len(lengths)} documents, "
          f"seq {args.seq}")
    print(f"{'samples':>10}{'build s':>10}{'Mtokens/s':>11}")
    print(f"{len(dataset):>10}{seconds:>10.2f}{tokens / seconds / 1e6:>11.0f}")


def loader_table(args, prefix: str) -> None:
    seq, mbs = max(args.seq // 8, 16), 8
    indexed = IndexedDataset(prefix)
    tokens = int(np.asarray(indexed.sequence_lengths).sum())
    dataset = GPTDataset(indexed, prefix, np.arange(len(indexed), dtype=np.int32), args.loader_samples,
                         "train", seq, seed=1234, eod=0)
    print(f"\nData loader (build_data_iterator, GPTDataset over the preprocessed corpus, {tokens} tokens): "
          f"seq {seq}, micro-batch {mbs}, {args.loader_samples} samples")
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
    args = ap.parse_args(argv)
    print(f"Data throughput; {load_average()}")
    with tempfile.TemporaryDirectory(prefix="megafab_data_bench_") as tmp:
        prefix = preprocess_table(args, tmp)
        index_table(args)
        loader_table(args, prefix)
    print(f"\nafter: {load_average()}")


if __name__ == "__main__":
    main()
