"""Pipeline schedules: no pipelining, 1F1B, interleaved 1F1B, behind one dispatcher.

    forward_backward = get_forward_backward_func(pp_size, vpp_size)
    logs = forward_backward(forward_step_func=..., data_iterator=..., model=...,
                            num_microbatches=m, seq_length=s, micro_batch_size=b, hidden_size=h,
                            topology=topo, dtype=torch.bfloat16)

Every schedule takes the same keyword arguments (Megatron's contract, see pipeline_steps.py;
microbatch_group_size_per_vp_stage shapes only the interleaved one) and returns the per-micro-batch
loss logs on the last stage (empty elsewhere). The loss of a call is the mean over micro-batches;
its backward accumulates into .grad. finalize_model_grads_func(models) runs once, at the end.

1F1B runs schedule_table's order: stage r's p-r-1 warmup forwards, one forward / one backward
(steady), the remaining backwards (cooldown); at most p-r micro-batches in flight, instead of m for
GPipe. Idle ("bubble") fraction: (p-1)/(m+p-1), about (p-1)/m.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megafab.distributed.p2p import P2PCommunicator, pipeline_tensor_shape
from megafab.distributed.pipeline_interleaved import forward_backward_pipelining_with_interleaving
from megafab.distributed.pipeline_steps import (
    GradSync,
    PipelineScheduleError,
    StepRunner,
    as_list,
    check_common,
    custom_backward,
    deallocate_output_tensor,
)
from megafab.distributed.schedule_table import STEADY, schedule_table
from megafab.distributed.topology import Topology

__all__ = [
    "PipelineScheduleError",
    "custom_backward",
    "deallocate_output_tensor",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
]

_NOTHING = object()  # no tensor received ahead for the next pass


def get_forward_backward_func(pp_size: int, vpp_size: int | None = 1) -> Callable:
    """The schedule for a layout: no pipelining, 1F1B, or interleaved 1F1B when vpp > 1."""
    vpp_size = vpp_size or 1
    if pp_size < 1 or vpp_size < 1:
        raise PipelineScheduleError(
            f"pipeline-model-parallel-size {pp_size} and virtual stages per rank {vpp_size} must "
            f"both be at least 1")
    if pp_size == 1:
        if vpp_size > 1:
            raise PipelineScheduleError(
                f"virtual pipeline stages ({vpp_size} per rank) need pipeline-model-parallel-size "
                f"> 1; drop --num-layers-per-virtual-pipeline-stage or raise the pipeline size")
        return forward_backward_no_pipelining
    if vpp_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator, model,
                                   num_microbatches: int, seq_length: int | None = None,
                                   micro_batch_size: int | None = None, hidden_size: int | None = None,
                                   topology: Topology | None = None, dtype: torch.dtype | None = None,
                                   forward_only: bool = False, sequence_parallel: bool = False,
                                   finalize_model_grads_func: Callable | None = None,
                                   no_sync_func=None, grad_sync_func: Callable | None = None,
                                   loss_scale=1.0, deallocate_pipeline_outputs: bool = True,
                                   timers=None, microbatch_group_size_per_vp_stage=None) -> list:
    """Gradient accumulation over micro-batches on one stage (pipeline size 1)."""
    models, iterators = as_list(model), as_list(data_iterator)
    if len(models) != 1:
        raise PipelineScheduleError(
            f"no-pipelining schedule got {len(models)} model chunks; it runs exactly one")
    check_common(num_microbatches, models, iterators)
    runner = StepRunner(forward_step_func, num_microbatches, forward_only, loss_scale, collect_logs=True,
                        timers=timers)
    sync = None if forward_only else GradSync(models, num_microbatches, no_sync_func, grad_sync_func)
    try:
        for _ in range(num_microbatches):
            loss = runner.forward(models[0], iterators[0], None, is_last_stage=True)
            if not forward_only:
                sync.before_backward(0)
                runner.backward(None, loss, None)
                sync.after_backward(0)
    finally:
        if sync is not None:
            sync.close()
    if not forward_only and finalize_model_grads_func is not None:
        finalize_model_grads_func(models)
    return runner.logs


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func: Callable, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, hidden_size: int, topology: Topology, dtype: torch.dtype,
        forward_only: bool = False, sequence_parallel: bool = False,
        finalize_model_grads_func: Callable | None = None, no_sync_func=None,
        grad_sync_func: Callable | None = None, loss_scale=1.0,
        deallocate_pipeline_outputs: bool = True, timers=None,
        microbatch_group_size_per_vp_stage=None) -> list:
    """1F1B: warmup forwards, steady one-forward-one-backward, cooldown backwards."""
    models, iterators = as_list(model), as_list(data_iterator)
    if len(models) != 1:
        raise PipelineScheduleError(
            f"1F1B schedule got {len(models)} model chunks; with virtual pipeline stages use "
            f"forward_backward_pipelining_with_interleaving (get_forward_backward_func(pp, vpp))")
    check_common(num_microbatches, models, iterators)
    chunk, data = models[0], iterators[0]
    shape = pipeline_tensor_shape(seq_length, micro_batch_size, hidden_size, topology.tp, sequence_parallel)
    comm = P2PCommunicator(topology, shape, dtype, timers)
    last = topology.is_last_stage
    runner = StepRunner(forward_step_func, num_microbatches, forward_only, loss_scale, collect_logs=last,
                        timers=timers)

    def forward(input_tensor):
        return runner.forward(chunk, data, input_tensor, is_last_stage=last)

    def free(output):
        if not last:
            deallocate_output_tensor(output, deallocate_pipeline_outputs)

    table = schedule_table(topology.pp_rank, topology.pp, num_microbatches, forward_only=forward_only)
    # Micro-batches whose forward ran and whose backward has not: (micro-batch, input, output).
    in_flight: list = []
    sync = None if forward_only else GradSync(models, num_microbatches, no_sync_func, grad_sync_func)

    def backward(input_tensor, output, output_grad):
        sync.before_backward(0)
        input_grad = runner.backward(input_tensor, output, output_grad)
        sync.after_backward(0)
        return input_grad

    # In the steady state a pass's exchange sends its result and receives the input of the next
    # pass, which goes the other way; every other pass receives its input on its own just before
    # it runs and sends its result on its own.
    received = _NOTHING
    try:
        for i, p in enumerate(table):
            turn = p.phase == STEADY and i + 1 < len(table) and table[i + 1].phase == STEADY
            if p.forward:
                input_tensor = comm.recv_forward() if received is _NOTHING else received
                output = forward(input_tensor)
                if turn:
                    received = comm.send_forward_recv_backward(output)
                else:
                    comm.send_forward(output)
                    received = _NOTHING
                if not forward_only:
                    in_flight.append((p.microbatch, input_tensor, output))
                free(output)
            else:
                output_grad = comm.recv_backward() if received is _NOTHING else received
                microbatch, input_tensor, output = in_flight.pop(0)
                assert microbatch == p.microbatch, (microbatch, p)
                input_grad = backward(input_tensor, output, output_grad)
                if turn:
                    received = comm.send_backward_recv_forward(input_grad)
                else:
                    comm.send_backward(input_grad)
                    received = _NOTHING
    finally:
        if sync is not None:
            sync.close()
    if not forward_only and finalize_model_grads_func is not None:
        finalize_model_grads_func(models)
    return runner.logs
