"""Point-to-point traffic between neighbouring pipeline stages.

Activations flow forward (stage r -> r+1), their gradients flow backward (r+1 -> r). Every
message has a shape known ahead from the config ([s/tp if SP else s, b, h]), so no shape is ever
exchanged: the receiver allocates a fresh buffer and posts a receive into it. An exchange is
deadlock-free on gloo (whose batch_isend_irecv runs each op as a separate isend/irecv) and on
NCCL (one batch_isend_irecv, one NCCL group) alike: see P2PCommunicator.exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megafab.distributed.pipeline_steps import timed
from megafab.distributed.topology import Topology
from megafab.errors import MegafabError
from megafab.run import faults

FORWARD_TAG = 1  # activations, stage r -> r+1
BACKWARD_TAG = 2  # activation gradients, stage r+1 -> r


class PipelineShapeError(MegafabError):
    """The pipeline tensor shape cannot be derived from the given sizes."""


def pipeline_tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int,
                          tp: int = 1, sequence_parallel: bool = False) -> tuple[int, int, int]:
    """Shape of what travels between stages: [s, b, h], or [s/tp, b, h] under sequence parallel."""
    if sequence_parallel and seq_length % tp != 0:
        raise PipelineShapeError(
            f"seq_length {seq_length} is not divisible by tensor-model-parallel-size {tp}; "
            f"sequence parallel splits the sequence over TP ranks, so choose a seq_length that "
            f"is a multiple of {tp}")
    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size),
                        ("hidden_size", hidden_size)):
        if value < 1:
            raise PipelineShapeError(f"{name} is {value}; it must be at least 1")
    s = seq_length // tp if sequence_parallel else seq_length
    return (s, micro_batch_size, hidden_size)


def _timer_name(send_next: bool, send_prev: bool, recv_prev: bool, recv_next: bool) -> str:
    """Megatron's timer of one exchange: forward-send, backward-send-forward-recv, ..."""
    sends = [d for d, on in (("forward", send_next), ("backward", send_prev)) if on]
    recvs = [d for d, on in (("forward", recv_prev), ("backward", recv_next)) if on]
    parts = (["-".join(sends) + "-send"] if sends else []) + (["-".join(recvs) + "-recv"] if recvs else [])
    return "-".join(parts)


class P2PCommunicator:
    """Sends and receives pipeline tensors of one fixed shape over the topology's PP group.

    The `*_forward` / `*_backward` helpers follow the physical stage: a first stage receives no
    activation and a last stage no gradient (they return None). The interleaved schedule, whose
    virtual stages wrap around the ring, calls `exchange` with explicit flags instead.
    """

    def __init__(self, topology: Topology, tensor_shape: tuple[int, ...], dtype: torch.dtype,
                 timers=None):
        self.topology = topology
        self.timers = timers
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = topology.device
        self.group = topology.group("pp")
        self.use_batched = topology.backend == "nccl"

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)

    def _check(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        assert tuple(tensor.shape) == self.tensor_shape, (
            f"{what} has shape {tuple(tensor.shape)}, pipeline expects {self.tensor_shape}")
        assert tensor.dtype == self.dtype, f"{what} has dtype {tensor.dtype}, pipeline expects {self.dtype}"
        return tensor.detach().contiguous()

    def exchange(self, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
                 recv_prev: bool = False, recv_next: bool = False
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One step of neighbour traffic; returns (tensor from prev, tensor from next).

        send_next: activation for the next stage; send_prev: gradient for the previous stage;
        recv_prev: expect an activation from the previous stage; recv_next: expect a gradient
        from the next stage. Returns only after every posted op has completed.

        Deadlock freedom (NCCL matches the sends and receives between a pair in posting order):
          1. ops are built in one canonical order: forward-direction traffic (send to next,
             receive from prev) before backward-direction traffic (send to prev, receive from next);
          2. each message is tagged with its direction, so with PP=2 (next and prev the same rank,
             and an interleaved step sending it an activation and a gradient at once) an activation
             is never taken for a gradient;
          3. every op is posted without blocking (even pipeline ranks their sends first, odd ranks
             their receives first, so neighbours never both wait to be served), then every request
             is waited on.
        On NCCL the first batch_isend_irecv must involve every rank of the group (lazy init).
        """
        topo = self.topology
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        # (is_send, tensor, peer, tag) in the canonical order described in the module docstring.
        sends, recvs = [], []
        if send_next is not None:
            sends.append((dist.isend, self._check(send_next, "activation sent forward"),
                          topo.next_pp_rank, FORWARD_TAG))
        if from_prev is not None:
            recvs.append((dist.irecv, from_prev, topo.prev_pp_rank, FORWARD_TAG))
        if send_prev is not None:
            sends.append((dist.isend, self._check(send_prev, "gradient sent backward"),
                          topo.prev_pp_rank, BACKWARD_TAG))
        if from_next is not None:
            recvs.append((dist.irecv, from_next, topo.next_pp_rank, BACKWARD_TAG))
        ops = sends + recvs if topo.pp_rank % 2 == 0 else recvs + sends
        if ops:
            name = _timer_name(send_next is not None, send_prev is not None, recv_prev, recv_next)
            with timed(self.timers, name, 2):
                self._run(ops)
        return from_prev, from_next

    def _run(self, ops) -> None:
        if self.use_batched:
            requests = dist.batch_isend_irecv(
                [dist.P2POp(op, t, peer, self.group, tag) for op, t, peer, tag in ops])
        else:
            requests = [op(t, peer, group=self.group, tag=tag) for op, t, peer, tag in ops]
        for request in requests:
            faults.wait(request, "pipeline send/recv", self.group)

    # Physical-stage helpers (no-op at the ends of the pipeline), Megatron's names.
    def recv_forward(self) -> torch.Tensor | None:
        if self.topology.is_first_stage:
            return None
        return self.exchange(recv_prev=True)[0]

    def recv_backward(self) -> torch.Tensor | None:
        if self.topology.is_last_stage:
            return None
        return self.exchange(recv_next=True)[1]

    def send_forward(self, output: torch.Tensor | None) -> None:
        if not self.topology.is_last_stage:
            self.exchange(send_next=output)

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        if not self.topology.is_first_stage:
            self.exchange(send_prev=input_grad)

    def send_forward_recv_backward(self, output: torch.Tensor | None) -> torch.Tensor | None:
        if self.topology.is_last_stage:
            return None
        return self.exchange(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        if self.topology.is_first_stage:
            return None
        return self.exchange(send_prev=input_grad, recv_prev=True)[0]

    # Virtual-stage helpers for the interleaved schedule: the caller decides every flag.
    def send_forward_recv_forward(self, output: torch.Tensor | None, recv_prev: bool) -> torch.Tensor | None:
        return self.exchange(send_next=output, recv_prev=recv_prev)[0]

    def send_backward_recv_backward(self, input_grad: torch.Tensor | None,
                                    recv_next: bool) -> torch.Tensor | None:
        return self.exchange(send_prev=input_grad, recv_next=recv_next)[1]

    def send_forward_backward_recv_forward_backward(
            self, output: torch.Tensor | None, input_grad: torch.Tensor | None, recv_prev: bool,
            recv_next: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.exchange(send_next=output, send_prev=input_grad, recv_prev=recv_prev,
                             recv_next=recv_next)
