"""Interleaved 1F1B (Megatron's virtual pipeline schedule).

Each of the p pipeline ranks holds v model chunks; chunk c on rank r is virtual stage c*p + r,
so a micro-batch visits rank 0, 1, ..., p-1, then rank 0 again (chunk 1), and so on: the
activation leaving rank p-1's chunk c enters rank 0's chunk c+1 (the ring wraps).

Forward passes are issued in groups of p micro-batches per chunk: for "virtual step" k (v*m of
them per rank),
    chunk(k)       = (k mod (p*v)) // p              (backward order reverses the chunks)
    micro-batch(k) = (k // (p*v)) * p + k mod p
which needs m to be a multiple of p. Warmup is 2*(p-r-1) + (v-1)*p forwards (all of them when
m == p), then 1F1B steps that each send one activation and one gradient at once, then cooldown.
The bubble shrinks to about (p-1)/(v*m) at the price of v times more p2p messages.
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
from megafab.distributed.topology import Topology


def check_interleaving(num_microbatches: int, pp: int, num_chunks: int, num_iterators: int) -> None:
    if num_chunks < 2:
        raise PipelineScheduleError(
            f"the interleaved schedule got {num_chunks} model chunk(s); it needs the list of this "
            f"rank's virtual stages (2 or more), otherwise use the 1F1B schedule")
    if num_iterators != num_chunks:
        raise PipelineScheduleError(
            f"the interleaved schedule needs one data iterator per model chunk ({num_chunks}), "
            f"got {num_iterators}")
    if num_microbatches % pp != 0:
        raise PipelineScheduleError(
            f"num_microbatches {num_microbatches} is not divisible by pipeline-model-parallel-size "
            f"{pp}; the interleaved schedule runs micro-batches in groups of {pp}, so pick a global "
            f"batch size giving a multiple of {pp} micro-batches, or drop virtual pipeline stages")


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func: Callable, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, hidden_size: int, topology: Topology, dtype: torch.dtype,
        forward_only: bool = False, sequence_parallel: bool = False,
        finalize_model_grads_func: Callable | None = None, no_sync_func=None,
        grad_sync_func: Callable | None = None, loss_scale=1.0,
        deallocate_pipeline_outputs: bool = True, timers=None) -> list:
    """Interleaved 1F1B over this rank's model chunks `model` (a list, chunk c = virtual stage c*p+r)."""
    models, iterators = as_list(model), as_list(data_iterator)
    pp, rank, vpp, m = topology.pp, topology.pp_rank, len(models), num_microbatches
    check_common(m, models, iterators)
    check_interleaving(m, pp, vpp, len(iterators))
    shape = pipeline_tensor_shape(seq_length, micro_batch_size, hidden_size, topology.tp, sequence_parallel)
    comm = P2PCommunicator(topology, shape, dtype, timers)
    first_rank, last_rank = topology.is_first_stage, topology.is_last_stage
    runner = StepRunner(forward_step_func, m, forward_only, loss_scale, collect_logs=last_rank,
                        timers=timers)

    total = m * vpp
    all_warmup = forward_only or m == pp
    num_warmup = total if all_warmup else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    num_steady = total - num_warmup

    def chunk_id(k: int, forward: bool) -> int:
        c = (k % (pp * vpp)) // pp
        return c if forward else vpp - 1 - c

    def is_first_virtual(c: int) -> bool:
        return first_rank and c == 0

    def is_last_virtual(c: int) -> bool:
        return last_rank and c == vpp - 1

    # Per chunk, oldest first: inputs received, outputs made, gradients received for them.
    input_tensors: list[list] = [[] for _ in range(vpp)]
    output_tensors: list[list] = [[] for _ in range(vpp)]
    output_grads: list[list] = [[] for _ in range(vpp)]
    sync = None if forward_only else GradSync(models, m, no_sync_func, grad_sync_func)

    def forward_step(k: int):
        c = chunk_id(k, forward=True)
        if is_first_virtual(c) and len(input_tensors[c]) == len(output_tensors[c]):
            input_tensors[c].append(None)
        output = runner.forward(models[c], iterators[c], input_tensors[c][-1], is_last_virtual(c))
        output_tensors[c].append(output)
        if forward_only:  # nothing will run backward: keep no references
            input_tensors[c].pop()
            output_tensors[c].pop()
        return output

    def backward_step(k: int):
        c = chunk_id(k, forward=False)
        if is_last_virtual(c) and not output_grads[c]:
            output_grads[c].append(None)
        sync.before_backward(c)
        input_grad = runner.backward(input_tensors[c].pop(0), output_tensors[c].pop(0),
                                     output_grads[c].pop(0))
        sync.after_backward(c)
        return input_grad

    def sent(output, c):
        """The activation to send forward, or None on the very last virtual stage (the loss)."""
        return None if is_last_virtual(c) else output

    try:
        input_tensors[0].append(comm.recv_forward())  # None on rank 0

        for k in range(num_warmup):
            c = chunk_id(k, forward=True)
            output = sent(forward_step(k), c)
            next_c = chunk_id(k + 1, forward=True)
            recv_prev = not (first_rank and next_c == 0) and k != total - 1
            if k == num_warmup - 1 and not all_warmup:
                recv_next = not last_rank
                input_tensor, output_grad = comm.send_forward_backward_recv_forward_backward(
                    output, None, recv_prev, recv_next)
                if recv_next:
                    output_grads[vpp - 1].append(output_grad)
            else:
                input_tensor = comm.send_forward_recv_forward(output, recv_prev)
            if recv_prev:
                input_tensors[next_c].append(input_tensor)
            deallocate_output_tensor(output, deallocate_pipeline_outputs)

        for i in range(num_steady):
            forward_k, backward_k = i + num_warmup, i
            forward_c = chunk_id(forward_k, forward=True)
            output = sent(forward_step(forward_k), forward_c)
            backward_c = chunk_id(backward_k, forward=False)
            input_grad = backward_step(backward_k)
            if is_first_virtual(backward_c):
                input_grad = None

            # Which chunk the next received activation / gradient belongs to. The ring wraps:
            # rank 0 receives what rank p-1 sent p-1 steps ago, for the following chunk.
            if first_rank:
                next_fc = chunk_id(forward_k - (pp - 1), forward=True)
                recv_prev = next_fc != vpp - 1
                next_fc += 1
            else:
                next_fc = chunk_id(forward_k + 1, forward=True)
                recv_prev = True
            if last_rank:
                next_bc = chunk_id(backward_k - (pp - 1), forward=False)
                recv_next = next_bc != 0
                next_bc -= 1
            else:
                next_bc = chunk_id(backward_k + 1, forward=False)
                recv_next = True
            if i == num_steady - 1:
                recv_prev = False

            input_tensor, output_grad = comm.send_forward_backward_recv_forward_backward(
                output, input_grad, recv_prev, recv_next)
            deallocate_output_tensor(output, deallocate_pipeline_outputs)
            if recv_prev:
                input_tensors[next_fc].append(input_tensor)
            if recv_next:
                output_grads[next_bc].append(output_grad)

        if not forward_only:
            if all_warmup:
                output_grads[vpp - 1].append(comm.recv_backward())
            for k in range(num_steady, total):
                c = chunk_id(k, forward=False)
                input_grad = backward_step(k)
                if is_first_virtual(c):
                    input_grad = None
                next_c = chunk_id(k + 1, forward=False)
                recv_next = not (last_rank and next_c == vpp - 1) and k != total - 1
                output_grad = comm.send_backward_recv_backward(input_grad, recv_next)
                if recv_next:
                    output_grads[next_c].append(output_grad)
    finally:
        if sync is not None:
            sync.close()
    if not forward_only and finalize_model_grads_func is not None:
        finalize_model_grads_func(models)
    return runner.logs
