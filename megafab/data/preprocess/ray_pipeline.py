"""The preprocess pipeline on Ray Data, for corpora that outgrow one machine; byte-identical to run_local.

    read units -> clean (+ fingerprints) -> [dedup, first copy wins, in input order] -> tokenize ->
    per-unit .bin/.idx (written by the workers under --ray-parts-dir) -> merge in input order

Units are the work Ray schedules: a plain jsonl file is cut at line starts every --block-mb bytes;
a compressed jsonl, a parquet file or a save_to_disk dataset is one unit per file. Each unit runs the
same process_block as the single-machine tool, on Ray actors that build the tokenizer once, so the
documents, their order, the cleaning verdicts, the token ids and the error messages are the same.

With --dedup / --near-dedup a first pass computes only the verdicts and fingerprints, the driver
decides duplicates over them in input order (dedup.py, the tool's own rule), and the second pass
tokenizes and writes only the survivors (run_ray). Without dedup there is one pass.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import time
from dataclasses import dataclass

from megafab.data.indexed_dataset import (
    IndexedDatasetWriter,
    data_file_path,
    dtype_for_vocab,
    index_file_path,
)
from megafab.data.indexed_dataset import merge_datasets as merge_prefixes
from megafab.data.preprocess.blocks import (
    Block,
    cut_spans,
    init_worker,
    is_plain_jsonl,
    process_block,
    read_blocks,
)
from megafab.data.preprocess.pipeline import Assembler, Plan, Summary, output_prefix_for
from megafab.data.readers import InputSource, require
from megafab.progress import Progress


@dataclass(frozen=True)
class Unit:
    source: InputSource
    start: int = 0  # byte span of a plain jsonl file; end None: the whole file, whatever its kind
    end: int | None = None


def plan_units(sources: tuple[InputSource, ...], block_bytes: int) -> list[Unit]:
    units = []
    for source in sources:
        if is_plain_jsonl(source):
            units.extend(Unit(source, a, b) for a, b in cut_spans(source.path, block_bytes))
        else:
            units.append(Unit(source))
    return units


def read_unit(unit: Unit, keys: list[str]) -> Block:
    if unit.end is not None:
        return Block(0, unit.source.path, None, unit.end - unit.start, (unit.start, unit.end))
    blocks = list(read_blocks([unit.source], keys, block_bytes=1 << 62))
    records = [r for b in blocks for r in b.read_records()]
    return Block(0, unit.source.path, records, sum(b.source_bytes for b in blocks))


class _UnitWorker:
    """A Ray actor: builds the tokenizer and cleaners once, then runs units."""

    def __init__(self, plan: Plan, units: list[Unit], phase: str, drops: dict, parts_dir: str):
        init_worker(plan.context)
        self.plan, self.units, self.phase, self.drops, self.parts_dir = plan, units, phase, drops, parts_dir

    def __call__(self, row: dict) -> dict:
        index = int(row["unit"])
        block = read_unit(self.units[index], list(self.plan.keys))
        if self.phase == "fingerprint":
            result = process_block(block, tokenize=False)
        else:
            result = process_block(block, drop=self.drops.get(index, frozenset()))
            _write_part(self.plan, self.parts_dir, index, result)
        result.keys = {}  # tokens stay in the part files
        return {"unit": index, "result": pickle.dumps(result)}


def part_prefix(parts_dir: str, index: int) -> str:
    return os.path.join(parts_dir, f"unit_{index:06d}")


def _write_part(plan: Plan, parts_dir: str, index: int, result) -> None:
    dtype = dtype_for_vocab(plan.context.vocab_size)
    for key, part in result.keys.items():
        prefix = output_prefix_for(part_prefix(parts_dir, index), key)
        writer = IndexedDatasetWriter(data_file_path(prefix), dtype)
        writer.add_packed(part.tokens, part.sequence_lengths, part.sequences_per_document)
        writer.finalize(index_file_path(prefix))


def _start_ray(address: str, workers: int):
    ray = require("ray", "--ray (the Ray Data pipeline)", "ray[data]")
    if not ray.is_initialized():
        # Workers import this megafab (not another installed copy) from the driver's source tree.
        package_root = os.path.dirname(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        )
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        runtime_env = {"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}}
        common = dict(log_to_driver=False, configure_logging=False, runtime_env=runtime_env)
        if address == "local":
            ray.init(num_cpus=workers, include_dashboard=False, **common)
        else:
            ray.init(address=address, **common)
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # results come back in unit order
    context.enable_progress_bars = False  # ours (tqdm, totals + ETA) is below
    return ray


def _run_pass(ray, plan: Plan, units: list[Unit], phase: str, drops: dict, parts_dir: str, workers: int):
    """Yields the BlockResult of every unit, in unit order."""
    dataset = ray.data.from_items([{"unit": i} for i in range(len(units))], override_num_blocks=len(units))
    dataset = dataset.map(
        _UnitWorker,
        fn_constructor_args=(plan, units, phase, drops, parts_dir),
        compute=ray.data.ActorPoolStrategy(size=max(1, workers)),
        num_cpus=1,
    )
    progress = Progress(len(units), f"ray {phase}", unit="unit", enabled=plan.progress)
    try:
        for row in dataset.iter_rows():
            progress.update(1)
            yield pickle.loads(row["result"])
    finally:
        progress.close()


def run_ray(plan: Plan, address: str, parts_dir: str | None = None) -> Summary:
    """The plan's input through Ray into prefix_KEY_document.bin/.idx. With dedup the driver holds
    every document's fingerprints (16 bytes + one 128-permutation signature) and the LSH buckets, so
    one run takes tens of millions of documents (benchmarks/README.md, Data); beyond that, shard the
    corpus into runs and merge."""
    ray = _start_ray(address, plan.workers)
    workers = plan.workers if address == "local" else int(ray.cluster_resources().get("CPU", plan.workers))
    parts_dir = parts_dir or f"{plan.output_prefix}_parts"
    os.makedirs(parts_dir, exist_ok=True)
    units = plan_units(plan.sources, plan.block_bytes)
    start = time.time()
    assembler = Assembler(plan)
    drops: dict[int, frozenset] = {}
    try:
        if plan.context.cleaning.fingerprints:
            for index, result in enumerate(
                _run_pass(ray, plan, units, "fingerprint", {}, parts_dir, workers)
            ):
                keep = assembler.keep(result)
                drops[index] = frozenset(int(i) for i in (~keep).nonzero()[0])
            for _ in _run_pass(ray, plan, units, "write", drops, parts_dir, workers):
                pass
        else:
            for result in _run_pass(ray, plan, units, "write", {}, parts_dir, workers):
                assembler.keep(result)
    except BaseException:
        shutil.rmtree(parts_dir, ignore_errors=True)
        raise
    summary = assembler.summary
    for key in plan.keys:
        names = [output_prefix_for(part_prefix(parts_dir, i), key) for i in range(len(units))]
        for name in names:
            summary.tokens += (
                os.path.getsize(data_file_path(name)) // dtype_for_vocab(plan.context.vocab_size)(0).itemsize
            )
        merge_prefixes(names, output_prefix_for(plan.output_prefix, key))
    shutil.rmtree(parts_dir, ignore_errors=True)
    summary.seconds = time.time() - start
    return summary
