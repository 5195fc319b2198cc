"""ordered_map: a function over items on `workers` processes (this one and workers - 1 forked), results
in input order, with a bounded number of items in flight.

Each forked worker has its own task pipe and result pipe and two items queued, so it never waits for
this process between items; this process hands the next item to a worker as soon as one returns a
result, and whenever it has nothing to yield and the window allows, takes the next item itself. A
worker that raises passes its error here; a worker that dies (killed for memory) is an error naming
it, never a hang (this process waits on the result pipes and the processes' sentinels together).
Workers are forked, so they start at once with everything this process built (the tokenizer, the
cleaners). Not multiprocessing.Pool: its handler threads cost this process more CPU than the work
at this grain, and it waits forever for a killed worker (benchmarks/README.md, Data).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait

from megafab.data.errors import DataError

QUEUED_PER_WORKER = 2


def keep_freed_memory() -> None:
    """glibc only: keep freed memory in this process for the next item (no trimming, heap allocations
    up to 32 MiB) instead of returning it and faulting it back in, ~2.5 us a page here. Memory stays
    at the largest item's working set."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
            libc.mallopt(-3, 1 << 25)  # M_MMAP_THRESHOLD (glibc's maximum)
    except OSError:
        pass


def _serve(fn: Callable, tasks: Connection, results: Connection) -> None:
    keep_freed_memory()
    while (task := tasks.recv()) is not None:
        index, item = task
        try:
            results.send((index, fn(item), None))
        except BaseException as e:  # noqa: BLE001 - the parent raises it
            error = e if isinstance(e, DataError) else RuntimeError(f"{type(e).__name__}: {e}")
            results.send((index, None, error))


def ordered_map(
    fn: Callable,
    items: Iterable,
    workers: int,
    local_fn: Callable | None = None,
    depth: int | None = None,
) -> Iterator:
    """fn over items in order on workers - 1 forked processes, local_fn (default fn) over the items
    this process takes; at most `depth` (default 3 x workers) items handed out and not yet yielded."""
    local_fn = local_fn or fn
    if workers == 1:
        yield from map(local_fn, items)
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the tokenizers library must not fork its threads
    context = multiprocessing.get_context("fork")
    processes, task_pipes, result_pipes = [], [], []
    try:
        for _ in range(workers - 1):
            task_reader, task_writer = context.Pipe(duplex=False)
            result_reader, result_writer = context.Pipe(duplex=False)
            process = context.Process(target=_serve, args=(fn, task_reader, result_writer), daemon=True)
            process.start()
            task_reader.close()
            result_writer.close()
            processes.append(process)
            task_pipes.append(task_writer)
            result_pipes.append(result_reader)
        pool = _Pool(processes, task_pipes, result_pipes)
        yield from pool.run(enumerate(items), local_fn, depth or 3 * workers)
        for pipe in task_pipes:
            pipe.send(None)
        for process in processes:
            process.join()
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()


class _Pool:
    def __init__(self, processes, task_pipes, result_pipes):
        self.processes, self.task_pipes, self.result_pipes = processes, task_pipes, result_pipes
        self.queued = [0] * len(processes)  # items handed to each worker and not returned
        self.done: dict = {}  # results that came back before the one to yield next
        self.worker_of = {id(pipe): w for w, pipe in enumerate(result_pipes)}

    def run(self, items: Iterator, local_fn: Callable, depth: int) -> Iterator:
        handed = yielded = 0
        exhausted = False

        def take():
            nonlocal handed, exhausted
            task = None if exhausted else next(items, None)
            exhausted = task is None
            handed += not exhausted
            return task

        while True:
            while handed - yielded < depth and min(self.queued) < QUEUED_PER_WORKER and (task := take()):
                worker = self.queued.index(min(self.queued))
                self.task_pipes[worker].send(task)
                self.queued[worker] += 1
            self.collect(timeout=0)
            if yielded in self.done:
                yield self.done.pop(yielded)
                yielded += 1
            elif exhausted and yielded == handed:
                return
            elif handed - yielded < depth and (task := take()):
                index, item = task
                self.done[index] = local_fn(item)
            else:
                self.collect(timeout=None)

    def collect(self, timeout: float | None) -> None:
        ready = wait(self.result_pipes + [p.sentinel for p in self.processes], timeout)
        for pipe in (r for r in ready if isinstance(r, Connection)):
            worker = self.worker_of[id(pipe)]
            try:
                index, result, error = pipe.recv()
            except EOFError:
                raise _died(self.processes[worker]) from None
            if error is not None:
                raise error
            self.done[index] = result
            self.queued[worker] -= 1
        for process in self.processes:
            if process.sentinel in ready:
                raise _died(process)


def _died(process) -> DataError:
    process.join()
    return DataError(
        f"a preprocess worker (pid {process.pid}) died with exit code {process.exitcode} (a negative code "
        "is the signal: -9 is often the out-of-memory killer); rerun with fewer --workers or a smaller "
        "--block-mb"
    )
