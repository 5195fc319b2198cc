"""The single-machine pipeline: blocks -> worker processes -> one writer per key, in input order.

Memory is bounded by the blocks in flight (2 x workers x --block-bytes of input and their tokens), not
by the corpus; the index grows by 12 bytes per document. --workers 1 runs in this process (no IPC);
N > 1 forks N workers that each parse, clean and tokenize whole blocks on one core, while this process
only reads bytes, decides duplicates and writes.

--partitions P follows Megatron's preprocess_data.py: the input's lines are dealt round-robin to P
partitions (contiguous ranges with --keep-sequential-samples), the P partitions run at the same time
with --workers / P workers each, and their outputs are merged in partition order.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
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
from megafab.data.preprocess.blocks import BlockResult, WorkerContext, init_worker, process_block, read_blocks
from megafab.data.preprocess.dedup import Deduplicator
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
    block_bytes: int = 4 << 20
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
                raise DataError(result.bad[0] + "; fix the line or pass --skip-bad-lines")
            self.summary.bad += len(result.bad)
            self.summary.report.remove("bad", 0, len(result.bad))
        report = self.summary.report
        if result.html_bytes_removed:
            report.remove("html", result.html_bytes_removed, 0)
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


def ordered_map(
    fn: Callable,
    items: Iterable,
    workers: int,
    initializer: Callable,
    initargs: tuple,
    depth: int | None = None,
) -> Iterator:
    """fn over items in order, on `workers` forked processes with at most `depth` items in flight."""
    if workers == 1:
        initializer(*initargs)
        yield from map(fn, items)
        return
    depth = depth or 2 * workers
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with multiprocessing.get_context("fork").Pool(workers, initializer, initargs) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= depth:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _remove_outputs(prefix: str, keys: Iterable[str]) -> None:
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
    try:
        blocks = read_blocks(list(plan.sources), list(plan.keys), plan.block_bytes, select)
        for result in ordered_map(process_block, blocks, plan.workers, init_worker, (plan.context,)):
            keep = assembler.keep(result)
            for key, writer in writers.items():
                part = result.keys[key].select(keep)
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
        _remove_outputs(prefix, plan.keys)
        raise
    finally:
        progress.close()
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
            _remove_outputs(part, plan.keys)
        raise errors[0]
    summary = Summary()
    for p in range(partitions):
        summary.add(results[p][0])
    for key in plan.keys:
        names = [output_prefix_for(part, key) for part in parts]
        merge_datasets(names, output_prefix_for(plan.output_prefix, key))
        for part in parts:
            _remove_outputs(part, [key])
    summary.seconds = time.time() - start
    return summary
