"""The pieces every pipeline schedule shares: one forward step, one backward step, freeing sent
activations, grad-sync control, and argument checks.

Megatron's contract:
  forward_step_func(data_iterator, model) -> (output_tensor, loss_func)
  loss_func(output_tensor) -> (loss_scalar, logs: dict)        # called on the last stage only
The schedule divides each micro-batch loss by num_microbatches (the total is then the mean over
micro-batches) and multiplies by loss_scale before backward.

timers (optional, every schedule): Megatron's `timers(name, log_level)` -> a context manager
(megafab.timers.Timers); the schedules time forward-compute, backward-compute (level 2) and, in
p2p, their sends and receives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.autograd.variable import Variable

from megafab.errors import MegafabError


class PipelineScheduleError(MegafabError):
    """A schedule that cannot run with the given arguments; the message names the fix."""


def timed(timers, name: str, log_level: int):
    """timers(name, log_level), or nothing to time without timers."""
    return timers(name, log_level) if timers is not None else contextlib.nullcontext()


def as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def deallocate_output_tensor(out: torch.Tensor | None, enabled: bool = True) -> None:
    """Drop the storage of an activation that has been sent to the next stage.

    Only its grad_fn is still needed (for backward), so its data is swapped for one element.
    Anything autograd saved keeps its own reference; what is freed is the [s, b, h] buffer that
    nobody but the schedule holds (e.g. the output of a residual add).
    """
    if out is None or not enabled:
        return
    assert out._base is None, (
        "the stage output is a view of another tensor, so freeing it frees nothing; return a "
        "viewless tensor from the last layer of the stage (e.g. .contiguous() on a fresh buffer)")
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backward from `output` with `grad_output`, even when output's data was deallocated.

    torch.autograd.backward checks that grad and output shapes agree; a freed output has one
    element, so call the C++ engine directly (it checks grads against the graph, not the data).
    """
    if grad_output is None:
        assert output.numel() == 1, "an implicit gradient needs a scalar output (the loss)"
        grad_output = torch.ones_like(output)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


class StepRunner:
    """Runs forward and backward steps for one schedule call and remembers the loss logs."""

    def __init__(self, forward_step_func: Callable, num_microbatches: int, forward_only: bool,
                 loss_scale, collect_logs: bool, timers=None):
        self.forward_step_func = forward_step_func
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.loss_scale = loss_scale
        self.logs: list = []
        self.collect_logs = collect_logs
        self.timers = timers

    def forward(self, model, data_iterator, input_tensor: torch.Tensor | None,
                is_last_stage: bool) -> torch.Tensor:
        """Forward one micro-batch on one model chunk; on the last stage returns loss / m."""
        if input_tensor is not None and not self.forward_only:
            input_tensor.requires_grad_(True)
        model.set_input_tensor(input_tensor)
        context = torch.no_grad() if self.forward_only else contextlib.nullcontext()
        with context, timed(self.timers, "forward-compute", 2):
            output, loss_func = self.forward_step_func(data_iterator, model)
            if is_last_stage:
                loss, logs = loss_func(output)
                if self.collect_logs:
                    self.logs.append(logs)
                output = loss / self.num_microbatches
        return output

    def backward(self, input_tensor: torch.Tensor | None, output: torch.Tensor,
                 output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backward one micro-batch; returns the gradient for the previous stage (or None)."""
        if input_tensor is not None:
            input_tensor.retain_grad()
        with timed(self.timers, "backward-compute", 2):
            if output_grad is None:  # last stage: output is the scaled micro-batch loss
                output = output * self.loss_scale
            custom_backward(output, output_grad)
        return None if input_tensor is None else input_tensor.grad


class GradSync:
    """Keeps gradient reduction off until each model chunk's last backward micro-batch.

    no_sync_func: one callable (or one per chunk) returning a context manager under which the
    data-parallel wrapper does not reduce gradients (like DDP.no_sync). grad_sync_func: called
    with a chunk right after that chunk's last backward, to launch its reduction.
    """

    def __init__(self, models: list, backwards_per_chunk: int, no_sync_func=None, grad_sync_func=None):
        self.models = models
        self.remaining = [backwards_per_chunk] * len(models)
        no_sync = as_list(no_sync_func) if no_sync_func is not None else [None]
        if len(no_sync) == 1:
            no_sync = no_sync * len(models)
        assert len(no_sync) == len(models), "no_sync_func: give one callable or one per model chunk"
        self.contexts = [fn() if fn is not None else None for fn in no_sync]
        self.grad_sync_func = grad_sync_func
        for ctx in self.contexts:
            if ctx is not None:
                ctx.__enter__()

    def before_backward(self, chunk: int) -> None:
        self.remaining[chunk] -= 1
        if self.remaining[chunk] == 0 and self.contexts[chunk] is not None:
            self.contexts[chunk].__exit__(None, None, None)
            self.contexts[chunk] = None

    def after_backward(self, chunk: int) -> None:
        if self.remaining[chunk] == 0 and self.grad_sync_func is not None:
            self.grad_sync_func(self.models[chunk])

    def close(self) -> None:
        """Leave any context still open (forward-only runs, or an error mid-schedule)."""
        for i, ctx in enumerate(self.contexts):
            if ctx is not None:
                ctx.__exit__(None, None, None)
                self.contexts[i] = None


def check_common(num_microbatches: int, models: list, data_iterators: list) -> None:
    if num_microbatches < 1:
        raise PipelineScheduleError(
            f"num_microbatches is {num_microbatches}; it must be at least 1 (global batch size / "
            f"(micro batch size x data-parallel size))")
    for chunk in models:
        if not hasattr(chunk, "set_input_tensor"):
            raise PipelineScheduleError(
                f"model chunk {type(chunk).__name__} has no set_input_tensor(tensor); pipeline "
                f"stages receive their input through it, so add that method to the model")
    if len(data_iterators) not in (1, len(models)):
        raise PipelineScheduleError(
            f"got {len(data_iterators)} data iterators for {len(models)} model chunks; pass one "
            f"iterator, or one per model chunk")
