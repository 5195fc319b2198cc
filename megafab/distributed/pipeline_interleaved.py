"""Interleaved 1F1B (Megatron's virtual pipeline schedule), running schedule_table's order.

Each of the p pipeline ranks holds v model chunks; chunk c on rank r is virtual stage c*p + r,
so a micro-batch visits rank 0, 1, ..., p-1, then rank 0 again (chunk 1), and so on: the
activation leaving rank p-1's chunk c enters rank 0's chunk c+1 (the ring wraps).

The passes and their order come from megafab.distributed.schedule_table (micro-batches in groups
of N = microbatch_group_size_per_vp_stage, default p). Communication is Megatron's, each exchange
blocking: after a warmup forward its activation goes out and the next input comes in; a steady
forward + backward pair sends and receives both ways in one exchange; a cooldown backward sends its
gradient and receives the next. What arrives is the input of this rank's next pass, except on the
leading rank of a direction (rank 0 forward, rank p-1 backward), which receives what the ending
rank made p-1 passes earlier, for the following chunk. The bubble shrinks to about (p-1)/(v*m) at
the price of v times more p2p messages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megafab.distributed.p2p import P2PCommunicator, pipeline_tensor_shape
from megafab.distributed.pipeline_steps import (
    GradSync,
    PipelineScheduleError,
    StepRunner,
    as_list,
    check_common,
    deallocate_output_tensor,
)
from megafab.distributed.schedule_table import (
    COOLDOWN,
    STEADY,
    interleaving_problem,
    schedule_table,
)
from megafab.distributed.topology import Topology


def check_interleaving(num_microbatches: int, pp: int, num_chunks: int, num_iterators: int,
                       group_size: int | None = None) -> None:
    if num_chunks < 2:
        raise PipelineScheduleError(
            f"the interleaved schedule got {num_chunks} model chunk(s); it needs the list of this "
            f"rank's virtual stages (2 or more), otherwise use the 1F1B schedule")
    if num_iterators != num_chunks:
        raise PipelineScheduleError(
            f"the interleaved schedule needs one data iterator per model chunk ({num_chunks}), "
            f"got {num_iterators}")
    problem = interleaving_problem(num_microbatches, pp, group_size)
    if problem is not None:
        raise PipelineScheduleError(problem)


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func: Callable, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, hidden_size: int, topology: Topology, dtype: torch.dtype,
        forward_only: bool = False, sequence_parallel: bool = False,
        finalize_model_grads_func: Callable | None = None, no_sync_func=None,
        grad_sync_func: Callable | None = None, loss_scale=1.0,
        deallocate_pipeline_outputs: bool = True, timers=None,
        microbatch_group_size_per_vp_stage: int | None = None) -> list:
    """Interleaved 1F1B over this rank's model chunks `model` (a list, chunk c = virtual stage c*p+r)."""
    models, iterators = as_list(model), as_list(data_iterator)
    pp, rank, vpp, m = topology.pp, topology.pp_rank, len(models), num_microbatches
    group = microbatch_group_size_per_vp_stage
    check_common(m, models, iterators)
    check_interleaving(m, pp, vpp, len(iterators), group)
    shape = pipeline_tensor_shape(seq_length, micro_batch_size, hidden_size, topology.tp, sequence_parallel)
    comm = P2PCommunicator(topology, shape, dtype, timers)
    first_rank, last_rank = topology.is_first_stage, topology.is_last_stage
    runner = StepRunner(forward_step_func, m, forward_only, loss_scale, collect_logs=last_rank,
                        timers=timers)

    table = schedule_table(rank, pp, m, vpp, group, forward_only)
    forwards = [p for p in table if p.forward]
    backwards = [p for p in table if not p.forward]
    total = m * vpp

    def arriving(k: int, forward: bool) -> tuple[int, int] | None:
        """(micro-batch, chunk) whose input arrives in the exchange after this rank's pass k of
        that direction (an activation for a forward, a gradient for a backward), or None."""
        if k == total - 1:
            return None
        passes = forwards if forward else backwards
        if not (first_rank if forward else last_rank):
            return passes[k + 1].microbatch, passes[k + 1].chunk
        if k < pp - 1:  # the ending rank has made nothing yet
            return None
        # what the ending rank sent after its pass k - (p-1), the same (micro-batch, chunk) as ours
        made = passes[k - (pp - 1)]
        if made.chunk == (vpp - 1 if forward else 0):  # the last virtual stage sends nothing on
            return None
        return made.microbatch, made.chunk + 1 if forward else made.chunk - 1

    def is_first_virtual(c: int) -> bool:
        return first_rank and c == 0

    def is_last_virtual(c: int) -> bool:
        return last_rank and c == vpp - 1

    # Keyed by (micro-batch, chunk): inputs received, outputs made, gradients received for them.
    inputs: dict = {}
    outputs: dict = {}
    output_grads: dict = {}
    sync = None if forward_only else GradSync(models, m, no_sync_func, grad_sync_func)

    def run_forward(p):
        """The forward; returns the activation to send, or None on the very last virtual stage."""
        key = (p.microbatch, p.chunk)
        if is_first_virtual(p.chunk):
            inputs[key] = None
        output = runner.forward(models[p.chunk], iterators[p.chunk], inputs[key], is_last_virtual(p.chunk))
        if forward_only:  # nothing will run backward: keep no references
            del inputs[key]
        else:
            outputs[key] = output
        return None if is_last_virtual(p.chunk) else output

    def run_backward(p):
        """The backward; returns the gradient to send, or None on the very first virtual stage."""
        key = (p.microbatch, p.chunk)
        output_grad = None if is_last_virtual(p.chunk) else output_grads.pop(key)
        sync.before_backward(p.chunk)
        input_grad = runner.backward(inputs.pop(key), outputs.pop(key), output_grad)
        sync.after_backward(p.chunk)
        return None if is_first_virtual(p.chunk) else input_grad

    def store(where: dict, key, tensor) -> None:
        if key is not None:
            where[key] = tensor

    try:
        store(inputs, (forwards[0].microbatch, forwards[0].chunk), comm.recv_forward())  # None on rank 0
        sent = forward_step = None  # a steady forward's activation and step, sent with its backward
        for i, p in enumerate(table):
            after = table[i + 1] if i + 1 < len(table) else None
            if p.forward:
                output = run_forward(p)
                if p.phase == STEADY:
                    sent, forward_step = output, p.step
                    continue
                next_input = arriving(p.step, forward=True)
                if after is not None and after.phase == STEADY:
                    # the last warmup forward also receives the first backward's gradient
                    grad_key = None if last_rank else (backwards[0].microbatch, backwards[0].chunk)
                    input_tensor, output_grad = comm.send_forward_backward_recv_forward_backward(
                        output, None, next_input is not None, grad_key is not None)
                    store(output_grads, grad_key, output_grad)
                else:
                    input_tensor = comm.send_forward_recv_forward(output, next_input is not None)
                store(inputs, next_input, input_tensor)
                deallocate_output_tensor(output, deallocate_pipeline_outputs)
                continue
            if p.phase == COOLDOWN and p.step == 0 and not last_rank:
                # every forward ran in the warmup: the first gradient is received on its own
                output_grads[(p.microbatch, p.chunk)] = comm.recv_backward()
            input_grad = run_backward(p)
            next_grad = arriving(p.step, forward=False)
            if p.phase == STEADY:
                next_input = arriving(forward_step, forward=True)
                input_tensor, output_grad = comm.send_forward_backward_recv_forward_backward(
                    sent, input_grad, next_input is not None, next_grad is not None)
                deallocate_output_tensor(sent, deallocate_pipeline_outputs)
                store(inputs, next_input, input_tensor)
            else:
                output_grad = comm.send_backward_recv_backward(input_grad, next_grad is not None)
            store(output_grads, next_grad, output_grad)
    finally:
        if sync is not None:
            sync.close()
    if not forward_only and finalize_model_grads_func is not None:
        finalize_model_grads_func(models)
    return runner.logs
