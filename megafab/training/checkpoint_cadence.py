"""When and how the training loop saves: every --save-interval iterations and on exit (else every
--non-persistent-save-interval, into the non-persistent directory), synchronously or (--async-save)
in the background, finalized at Megatron's safe points: the start of each
iteration (non-blocking), before the next save, at the end of training and on exit (blocking). An
error only waits for this rank's writer: the unfinalized save never becomes the latest.
"""

from __future__ import annotations

from megafab.checkpoint import checkpointing, non_persistent
from megafab.checkpoint.async_save import AsyncSaver


class CheckpointCadence:
    def __init__(self, state, watch=None, record=None, progress=None):
        """record: called with a dict for the run's metrics.jsonl (an async save's stall and staging);
        progress: the run's progress_log.ProgressLog (--log-progress), told of each save."""
        ck = state.cfg.checkpoint
        self.state, self.watch, self.record, self.progress = state, watch, record, progress
        finalized = progress.saved_async if progress is not None else None
        self.saver = AsyncSaver(finalized) if ck.save and ck.async_save else None
        self.first_iteration, self.prepared = state.iteration, False

    def _where(self, text: str) -> None:
        if self.watch is not None:
            self.watch.where = text

    def at_iteration_start(self) -> None:
        """Megatron's maybe_finalize_async_save(blocking=False): a collective only while a save is pending.
        After the first step (the optimizer state exists) the async saver sizes its staging memory."""
        if self.saver is not None and not self.prepared and self.state.iteration > self.first_iteration:
            self.prepared = True
            self.saver.prepare(self.state)
        if self.saver is not None and self.saver.pending is not None:
            self._where(f"finalizing the asynchronous save of iteration {self.saver.pending_iteration}")
            self.saver.maybe_finalize(self.state.topology)

    def due(self) -> bool:
        ck, iteration = self.state.cfg.checkpoint, self.state.iteration
        return bool(ck.save and ck.save_interval and iteration % ck.save_interval == 0)

    def non_persistent_due(self) -> bool:
        ck, iteration = self.state.cfg.checkpoint, self.state.iteration
        return bool(non_persistent.enabled(ck) and ck.non_persistent_save_interval and
                    iteration % ck.non_persistent_save_interval == 0)

    def save(self, root: str | None = None) -> None:
        """Into --save (then its progress line, as Megatron's save_checkpoint_and_time), or into `root`
        (a non-persistent directory)."""
        self._where(f"the checkpoint save of iteration {self.state.iteration}")
        if self.saver is None:
            retired = self.progress.deleted if self.progress is not None else None
            checkpointing.save_checkpoint(self.state, root, retired)
        else:
            self.saver.schedule(self.state, root)
            if self.record is not None:
                p = self.saver.pending
                self.record({"kind": "async_save", "iteration": p.iteration, "path": p.root,
                             "stall_s": p.stall_s, "staged_bytes_max_per_rank": p.staged_max})
        if root is None and self.progress is not None:
            self.progress.after_save(self.state)

    def save_non_persistent(self) -> None:
        """Megatron's: into the non-persistent directory, the older ones there removed first."""
        self.finish()
        root = non_persistent.save_root(self.state.cfg.checkpoint)
        if self.state.topology.rank == 0:
            non_persistent.remove_older(root)
        self.save(root)

    def saved_now(self) -> bool:
        """The current iteration is the latest checkpoint, or is being saved."""
        ck = self.state.cfg.checkpoint
        pending = self.saver is not None and self.saver.pending_iteration == self.state.iteration
        return pending or checkpointing.latest_iteration(ck.save) == self.state.iteration

    def finish(self) -> None:
        """Collective: finalize the pending save, waiting for it (end of training, exit)."""
        if self.saver is not None and self.saver.pending is not None:
            self._where(f"finalizing the asynchronous save of iteration {self.saver.pending_iteration}")
            if self.state.topology.rank == 0:
                print("Unfinalized async checkpoint saves. Finalizing them synchronously now.", flush=True)
            self.saver.maybe_finalize(self.state.topology, blocking=True)

    def close(self) -> None:
        """The end of training (after finish): the async writer process ends."""
        if self.saver is not None:
            self.saver.close()

    def abandon(self) -> None:
        if self.saver is not None:
            self.saver.abandon(self.state.topology)
