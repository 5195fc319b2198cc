"""The single-machine pipeline: blocks -> worker processes -> one writer per key, in input order.

Memory is bounded by the blocks in flight (3 x workers x --block-bytes of input and their tokens), not
by the corpus; the index grows by 12 bytes per document. --workers N tokenizes on N processes: this
one and N - 1 forked after it built the tokenizer and the cleaners (ordered_pool.py). A worker
reads, cleans and tokenizes its own span, writes the block's tokens to a part file (SpillTokens)
and sends back only the index (lengths, verdicts, fingerprints); this process tokenizes blocks
itself whenever it would otherwise wait, decides duplicates (Assembler), and appends each part to
the .bin in input order.

--partitions P follows Megatron's preprocess_data.py: the input's lines are dealt round-robin to P
partitions (contiguous ranges with --keep-sequential-samples), the P partitions run at the same time
with --workers / P workers each, and their outputs are merged in partition order.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from megafab.data.errors import DataError
from megafab.data.indexed_dataset import (
    IndexedDatasetWriter,
    data_file_path,
    dtype_for_vocab,
    index_file_path,
    merge_datasets,
)
from megafab.data.preprocess.blocks import (
    DEFAULT_BLOCK_BYTES,
    Block,
    BlockResult,
    PackedKey,
    WorkerContext,
    init_worker,
    process_block,
    read_blocks,
)
from megafab.data.preprocess.dedup import Deduplicator
from megafab.data.preprocess.ordered_pool import keep_freed_memory, ordered_map
from megafab.data.preprocess.report import CleaningReport
from megafab.data.readers import InputSource, jsonl_lines, read_records
from megafab.progress import Progress


def output_prefix_for(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


@dataclass(frozen=True)
class Plan:
    """Everything one run needs; picklable (partitions fork it, Ray ships it)."""

    sources: tuple[InputSource, ...]
    context: WorkerContext
    output_prefix: str
    workers: int = 1
    block_bytes: int = DEFAULT_BLOCK_BYTES
    skip_bad_lines: bool = False
    log_interval: int = 1000
    progress: bool | None = None  # None: a bar when stderr is a terminal
    engine_name: str = ""  # the tokenizing engine, for the summary line

    @property
    def keys(self) -> tuple[str, ...]:
        return self.context.keys


@dataclass
class Summary:
    documents: int = 0
    bytes: int = 0
    tokens: int = 0
    bad: int = 0
    seconds: float = 0.0
    report: CleaningReport = field(default_factory=CleaningReport)

    def add(self, other: Summary) -> None:
        self.documents += other.documents
        self.bytes += other.bytes
        self.tokens += other.tokens
        self.bad += other.bad
        for rule, (d, b) in other.report.removed.items():
            self.report.remove(rule, b, d)
        self.report.keep(other.report.kept[1], other.report.kept[0])


class Assembler:
    """Takes block results in input order: refuses or counts bad lines, decides duplicates, counts
    the report; keep(result) -> mask over the documents the cleaning rules kept."""

    def __init__(self, plan: Plan):
        cleaning = plan.context.cleaning
        self.skip_bad_lines = plan.skip_bad_lines
        self.dedup = Deduplicator(cleaning.dedup, cleaning.near_dedup) if cleaning.fingerprints else None
        self.summary = Summary()

    def keep(self, result: BlockResult) -> np.ndarray:
        if result.bad:
            if not self.skip_bad_lines:
                number, reason = result.bad[0]
                raise DataError(
                    f"{result.bad_line_label(number)}: {reason}; fix the line or pass --skip-bad-lines"
                )
            self.summary.bad += len(result.bad)
            self.summary.report.remove("bad", 0, len(result.bad))
        report = self.summary.report
        if result.html_bytes_removed:
            report.remove("html", result.html_bytes_removed, 0)
        if self.dedup is None and all(v is None for v in result.verdicts):  # the common case, at once
            total = int(result.text_bytes.sum())
            report.keep(total, len(result.verdicts))
            self.summary.documents += len(result.verdicts)
            self.summary.bytes += total
            return np.ones(len(result.verdicts), dtype=bool)
        keep = []  # one entry per document the cleaning rules kept (those result.keys holds)
        for verdict, nbytes in zip(result.verdicts, result.text_bytes.tolist()):
            if verdict is None:
                if self.dedup is not None:
                    j = len(keep)
                    verdict = self.dedup.check(
                        result.digests[j] if result.digests is not None else None,
                        result.signatures[j] if result.signatures is not None else None,
                    )
                keep.append(verdict is None)
            if verdict is None:
                report.keep(nbytes)
                self.summary.documents += 1
                self.summary.bytes += nbytes
            else:
                report.remove(verdict, nbytes)
        return np.asarray(keep, dtype=bool)


@dataclass(frozen=True)
class SpillTokens:
    """process_block in a worker, with each key's tokens written to a part file in `directory` (read
    back by load_tokens) instead of pickled through the pool's pipe: tokens through pipes cost more
    CPU than tokenizing them with gigatoken."""

    directory: str

    def __call__(self, block: Block) -> BlockResult:
        result = process_block(block)
        for number, part in enumerate(result.keys.values()):
            path = os.path.join(self.directory, f"{block.index}.{number}.bin")
            part.tokens.tofile(path)
            part.tokens = path
        return result


def load_tokens(part: PackedKey, dtype) -> np.ndarray:
    """A block's tokens: the array itself, or read from its part file (which is deleted)."""
    if not isinstance(part.tokens, str):
        return part.tokens
    tokens = np.fromfile(part.tokens, dtype)
    os.remove(part.tokens)
    return tokens


def remove_outputs(prefix: str, keys: Iterable[str]) -> None:
    for key in keys:
        for path in (
            data_file_path(output_prefix_for(prefix, key)),
            index_file_path(output_prefix_for(prefix, key)),
        ):
            if os.path.exists(path):
                os.remove(path)


def total_input_bytes(sources: Iterable[InputSource]) -> int | None:
    try:
        return sum(os.path.getsize(s.path) for s in sources if os.path.isfile(s.path)) or None
    except OSError:
        return None


def run_local(
    plan: Plan,
    select: Callable[[int], bool] | None = None,
    prefix: str | None = None,
    describe: str = "tokenizing",
) -> Summary:
    """Tokenize the plan's input (the records select() chooses) into prefix_KEY_document.bin/.idx."""
    prefix = prefix or plan.output_prefix
    dtype = dtype_for_vocab(plan.context.vocab_size)
    writers = {
        key: IndexedDatasetWriter(data_file_path(output_prefix_for(prefix, key)), dtype) for key in plan.keys
    }
    assembler = Assembler(plan)
    summary = assembler.summary
    progress = Progress(total_input_bytes(plan.sources), describe, enabled=plan.progress)
    start = time.time()
    next_log = plan.log_interval
    parts_dir = None
    try:
        init_worker(plan.context)  # here, before the fork: the workers inherit the tokenizer
        keep_freed_memory()  # this process tokenizes too
        work = process_block
        if plan.workers > 1:
            parts_dir = tempfile.mkdtemp(
                prefix=f".{os.path.basename(prefix)}_parts_", dir=os.path.dirname(prefix) or "."
            )
            work = SpillTokens(parts_dir)
        blocks = read_blocks(list(plan.sources), list(plan.keys), plan.block_bytes, select, plan.workers)
        for result in ordered_map(work, blocks, plan.workers, local_fn=process_block):
            keep = assembler.keep(result)
            for key, writer in writers.items():
                packed = result.keys[key]
                packed.tokens = load_tokens(packed, dtype)
                part = packed.select(keep)
                writer.add_packed(part.tokens, part.sequence_lengths, part.sequences_per_document)
                summary.tokens += int(part.tokens.size)
            progress.update(result.source_bytes, docs=summary.documents)
            if summary.documents >= next_log:
                elapsed = max(time.time() - start, 1e-9)
                progress.write(
                    f"processed {summary.documents} documents ({summary.documents / elapsed:.0f} "
                    f"docs/s, {summary.bytes / elapsed / 1e6:.2f} MB/s)"
                )
                next_log = (summary.documents // plan.log_interval + 1) * plan.log_interval
        for key, writer in writers.items():
            writer.finalize(index_file_path(output_prefix_for(prefix, key)))
    except BaseException:
        for writer in writers.values():
            writer._file.close()
        remove_outputs(prefix, plan.keys)
        raise
    finally:
        progress.close()
        if parts_dir is not None:
            shutil.rmtree(parts_dir, ignore_errors=True)
    summary.seconds = time.time() - start
    return summary


# ---- --partitions ---------------------------------------------------------------------------------------


def count_records(sources: Iterable[InputSource], keys: list[str]) -> int:
    total = 0
    for source in sources:
        if source.kind == "jsonl":
            total += sum(1 for _ in jsonl_lines(source.path))
        else:
            total += sum(1 for _ in read_records(source, keys))
    return total


def partition_selector(partition: int, partitions: int, sequential_size: int | None) -> Callable[[int], bool]:
    """Megatron's assignment of line i: i % P round-robin, or i // ceil(lines / P) when sequential."""
    if sequential_size is None:
        return lambda i: i % partitions == partition
    return lambda i: i // sequential_size == partition


def _partition_main(plan: Plan, partition: int, partitions: int, size: int | None, queue) -> None:
    try:
        summary = run_local(
            plan,
            partition_selector(partition, partitions, size),
            f"{plan.output_prefix}_{partition}",
            describe=f"partition {partition}",
        )
        queue.put((partition, summary, None))
    except BaseException as e:  # noqa: BLE001 - the parent reports it and exits
        queue.put((partition, None, e if isinstance(e, DataError) else RuntimeError(repr(e))))


def run_partitions(plan: Plan, partitions: int, keep_sequential_samples: bool) -> Summary:
    if plan.workers % partitions:
        raise DataError(
            f"--workers {plan.workers} --partitions {partitions}: Megatron gives each partition "
            "workers / partitions processes, so --workers must be a multiple of --partitions"
        )
    if plan.context.cleaning.fingerprints:
        raise DataError(
            "--dedup / --near-dedup with --partitions > 1 would remove duplicates only inside each "
            "partition; deduplicate with --partitions 1 and --workers N instead"
        )
    size = None
    if keep_sequential_samples:
        size = max(1, math.ceil(count_records(plan.sources, list(plan.keys)) / partitions))
    part_plan = dataclasses.replace(plan, workers=plan.workers // partitions, progress=False)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [
        context.Process(target=_partition_main, args=(part_plan, p, partitions, size, queue))
        for p in range(partitions)
    ]
    start = time.time()
    for process in processes:
        process.start()
    results = dict((p, (s, e)) for p, s, e in (queue.get() for _ in processes))
    for process in processes:
        process.join()
    parts = [f"{plan.output_prefix}_{p}" for p in range(partitions)]
    errors = [e for _, e in results.values() if e is not None]
    if errors:
        for part in parts:
            remove_outputs(part, plan.keys)
        raise errors[0]
    summary = Summary()
    for p in range(partitions):
        summary.add(results[p][0])
    for key in plan.keys:
        names = [output_prefix_for(part, key) for part in parts]
        merge_datasets(names, output_prefix_for(plan.output_prefix, key))
        for part in parts:
            remove_outputs(part, [key])
    summary.seconds = time.time() - start
    return summary
