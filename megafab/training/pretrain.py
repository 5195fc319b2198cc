"""The training loop: iterate, log Megatron's lines, evaluate, checkpoint, exit on request."""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

from megafab.checkpoint import checkpointing, non_persistent
from megafab.run import determinism
from megafab.run.faults import FaultWatch
from megafab.run.launch import restart_count
from megafab.run.signals import SigtermFlag
from megafab.training.batch_size import batch_problem_at, num_micro_batches_at, train_iterations
from megafab.training.build import (
    TrainState,
    build_model,
    build_optimizer,
    build_scheduler,
    init_distributed,
)
from megafab.training.checkpoint_cadence import CheckpointCadence
from megafab.training.data_setup import attach_tokenizer, build_data_iterators, build_datasets
from megafab.training.loop_hooks import ManualGC, StepProfiler, setup_logging
from megafab.training.progress_log import STARTING, ProgressLog
from megafab.training.run_record import (
    arguments_block,
    parameter_lines,
    parameters_per_rank,
    run_directory,
    world_layout_line,
    write_resolved_config,
)
from megafab.training.step import evaluate, train_step
from megafab.training.train_log import TrainingLog
from megafab.training.weight_hash import check_weight_hashes


def print_rank_0(topo, text: str) -> None:
    if topo.rank == 0:
        print(text, flush=True)


def resume_after_restart(cfg):
    """(config, note): under torchrun --max-restarts a restarted job continues from the newest
    checkpoint in --save (whatever --load or --finetune asked for the first attempt), so no step is
    trained twice; the config is a new one saying so (a finalized config is never changed)."""
    ck = cfg.checkpoint
    attempt = restart_count()
    nothing = checkpointing.latest_iteration(ck.save) is None and \
        non_persistent.newest(non_persistent.load_root(ck, ck.save)) is None if ck.save else True
    if attempt == 0 or nothing:
        said = non_persistent.enabled(ck) and attempt > 0 and ck.save and not ck.load
        return cfg, (f"megafab: note: torchrun restart {attempt}: no checkpoint in --save {ck.save} nor in "
                     f"its non-persistent directory; training from scratch") if said else None
    asked = f" instead of --load {ck.load}{' --finetune' if ck.finetune else ''}" if ck.load else ""
    note = (f"megafab: note: torchrun restart {attempt}: resuming from the latest checkpoint in --save "
            f"{ck.save}{asked}")
    resumed = dataclasses.replace(cfg, checkpoint=dataclasses.replace(ck, load=ck.save, finetune=False))
    return resumed.freeze(), note


def setup(cfg, topo, tracker) -> TrainState:
    model = build_model(cfg, topo, tracker)
    optimizer = build_optimizer(cfg, topo, model)
    scheduler = build_scheduler(cfg, optimizer)
    state = TrainState(cfg, topo, tracker, model, optimizer, scheduler)
    if cfg.checkpoint.load or cfg.checkpoint.pretrained_checkpoint:
        checkpointing.load_checkpoint(state)
    if (problem := batch_problem_at(cfg, state.consumed_train_samples)) is not None:
        raise problem
    return state


def _should_exit(state, start_time: float, sigterm: SigtermFlag) -> str | None:
    t = state.cfg.training
    if t.exit_signal_handler and sigterm.any_rank(state.topology.device):
        return "SIGTERM received"
    if t.exit_interval and state.iteration % t.exit_interval == 0:
        return f"exit interval {t.exit_interval}"
    if t.exit_duration_in_mins:
        elapsed = torch.tensor([(time.time() - start_time) / 60.0], device=state.topology.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if elapsed.item() > t.exit_duration_in_mins:
            return f"exit duration {t.exit_duration_in_mins} min"
    return None


def train(state: TrainState, iterators, log: TrainingLog, gc_control: ManualGC,
          watch: FaultWatch | None = None, progress: ProgressLog | None = None) -> None:
    """watch: told what the job is doing (for a dead or frozen rank's report); progress: --log-progress's."""
    cfg, topo = state.cfg, state.topology
    t = cfg.training
    total = train_iterations(cfg)
    train_iter, valid_iter, _ = iterators
    sigterm = SigtermFlag(t.exit_signal_handler)
    profiler = StepProfiler(cfg, topo.rank, topo.device)
    saves = CheckpointCadence(state, watch, record=log.record, progress=progress)
    start = time.time()
    micro_batches = num_micro_batches_at(cfg, state.consumed_train_samples)
    hash_every = t.check_weight_hash_across_dp_replicas_interval
    if hash_every:
        print_rank_0(topo, check_weight_hashes(state))
    try:
        while state.iteration < total:
            saves.at_iteration_start()
            # Megatron saves a checkpoint where a batch-size ramp changes the number of micro-batches
            previous, micro_batches = micro_batches, num_micro_batches_at(cfg, state.consumed_train_samples)
            if micro_batches != previous and cfg.checkpoint.save and not saves.saved_now():
                saves.save()
            profiler.before_step(state.iteration)
            if watch is not None:
                watch.where = f"iteration {state.iteration + 1}"
            metrics = train_step(state, train_iter, log.timers)
            gc_control.after_step(state.iteration)
            log.after_step(state, metrics)
            if hash_every and state.iteration % hash_every == 0:
                print_rank_0(topo, check_weight_hashes(state))
            if t.eval_interval and state.iteration % t.eval_interval == 0 and valid_iter is not None:
                if watch is not None:
                    watch.where = f"the validation after iteration {state.iteration}"
                with gc_control.evaluation():
                    run_evaluation(state, valid_iter, "validation", log)
            if saves.due():
                saves.save()
            elif saves.non_persistent_due():
                saves.save_non_persistent()
            reason = _should_exit(state, start, sigterm)
            if reason:
                if cfg.checkpoint.save and not saves.saved_now():
                    saves.save()
                saves.finish()
                print_rank_0(topo, f"exiting at iteration {state.iteration}: {reason}")
                return
        saves.finish()
    except BaseException:
        saves.abandon()
        raise
    finally:
        saves.close()
        profiler.stop()


def run_evaluation(state, data_iterator, label: str, log: TrainingLog,
                   where: str | None = None) -> float | None:
    """where: Megatron's prefix after "<label> loss at", default "iteration N"."""
    loss = evaluate(state, data_iterator, state.cfg.training.eval_iters,
                    counts_as_validation=label == "validation")
    log.evaluation(state, label, where or f"iteration {state.iteration}", loss)
    return loss


def record_start(state) -> None:
    """The start-up summary (layout, resolved arguments, parameters per stage; rank 0) and the
    resolved configuration as a file in the run directory."""
    cfg, topo = state.cfg, state.topology
    print_rank_0(topo, world_layout_line(topo, cfg))
    print_rank_0(topo, arguments_block(cfg))
    print_rank_0(topo, "\n".join(parameter_lines(parameters_per_rank(state.model, topo))))
    directory = run_directory(cfg)
    if directory and topo.rank == 0:
        path = write_resolved_config(cfg, directory)
        print_rank_0(topo, f"megafab: resolved configuration written to {path}")


def pretrain(cfg) -> int:
    job_start = time.time()
    setup_logging(cfg.logging.logging_level)
    if cfg.training.deterministic_mode:  # before the process group and the first kernel
        determinism.apply(os.environ)
    cfg, restart_note = resume_after_restart(cfg)
    tokenizer = attach_tokenizer(cfg)
    topo, tracker = init_distributed(cfg)
    with FaultWatch.start(timeout_s=cfg.parallel.distributed_timeout_minutes * 60) as watch:
        cp = f" cp {topo.cp}" if topo.cp > 1 else ""
        print_rank_0(topo, f"megafab: {topo.world_size} process(es), tp {topo.tp}{cp} pp {topo.pp} "
                           f"dp {topo.dp}, {topo.device} / {topo.backend}")
        notes = cfg.start_up_notes()
        if cfg.training.empty_unused_memory_level and topo.device.type != "cuda":
            notes.append(f"accepted, no effect on {topo.device.type}: --empty-unused-memory-level "
                         f"(only CUDA's caching allocator holds unused memory)")
        for note in notes:
            print_rank_0(topo, f"megafab: note: {note}")
        if restart_note:
            print_rank_0(topo, restart_note)
        non_persistent.check_one_node(cfg.checkpoint, topo)
        progress = ProgressLog(cfg, topo, job_start=job_start)
        progress.append(STARTING)
        watch.where = "building the datasets"
        datasets = build_datasets(cfg, topo, tokenizer)  # a bad data file stops the run before the model
        watch.where = "building the model and loading the checkpoint"
        state = setup(cfg, topo, tracker)
        progress.start_flops = state.num_floating_point_operations_so_far
        record_start(state)
        iterators = build_data_iterators(cfg, topo, state.consumed_train_samples, datasets=datasets,
                                         consumed_valid_samples=state.consumed_valid_samples)
        checkpointing.restore_pending_rng(state)
        log = TrainingLog(cfg, topo, state.iteration)
        gc_control = ManualGC(cfg.training)
        try:
            if not cfg.training.skip_train:
                train(state, iterators, log, gc_control, watch, progress)
            watch.where = "the evaluation at the end of training"
            total = train_iterations(cfg)
            with gc_control.evaluation():
                if iterators[1] is not None and cfg.training.eval_iters and state.iteration >= total:
                    run_evaluation(state, iterators[1], "validation", log, "the end of training for val data")
                if iterators[2] is not None and cfg.training.eval_iters and state.iteration >= total:
                    run_evaluation(state, iterators[2], "test", log, "the end of training for test data")
            if cfg.checkpoint.save and state.iteration >= total and \
                    checkpointing.latest_iteration(cfg.checkpoint.save) != state.iteration:
                watch.where = f"the checkpoint save of iteration {state.iteration}"
                checkpointing.save_checkpoint(state, on_retired=progress.deleted)
        finally:
            log.close()
            gc_control.close()
        watch.where = "the barrier at the end of training"
        dist.barrier()
        watch.close()
    dist.destroy_process_group()
    return 0
