"""Megatron's named timers (--timing-log-level, --timing-log-option): each timer has a level; one
above --timing-log-level costs nothing (a null timer). Every rank times its own work, and at each
--log-interval the ranks gather their totals and the last rank prints them in Megatron's format:

    (min, max) time across ranks (ms):
        forward-backward ...............................: (812.31, 815.02)

Values are milliseconds per iteration (totals / iterations since the last report). Level 1: once
per step (forward-backward, all-grads-sync, optimizer); level 2: per micro-batch (forward-compute,
backward-compute, batch-generator, the pipeline's send/recv). A timer waits for the accelerator at
start and stop (on CUDA), so levels 1-2 measure true durations and may slow the step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

LEVEL_1 = ("forward-backward", "all-grads-sync", "optimizer")
LEVEL_2 = ("batch-generator", "forward-compute", "backward-compute", "forward-recv", "forward-send",
           "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
           "backward-send-forward-recv", "backward-send-backward-recv",
           "forward-backward-send-forward-backward-recv")


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class NullTimer:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


NULL_TIMER = NullTimer()


class Timer(NullTimer):
    def __init__(self, device: torch.device | None):
        self.device = device
        self.elapsed = 0.0  # seconds since the last report
        self._started: float | None = None

    def start(self) -> None:
        assert self._started is None, "timer started twice"
        _synchronize(self.device)
        self._started = time.perf_counter()

    def stop(self) -> None:
        assert self._started is not None, "timer stopped before it started"
        _synchronize(self.device)
        self.elapsed += time.perf_counter() - self._started
        self._started = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Timers:
    """timers(name, log_level) -> a Timer (or the null timer above --timing-log-level)."""

    def __init__(self, log_level: int = 0, log_option: str = "minmax", device: torch.device | None = None):
        self.log_level, self.log_option, self.device = log_level, log_option, device
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str, log_level: int = 0) -> NullTimer:
        if log_level > self.log_level:
            return NULL_TIMER
        if name not in self._timers:
            self._timers[name] = Timer(self.device)
        return self._timers[name]

    def reported_names(self) -> tuple[str, ...]:
        return (LEVEL_1 if self.log_level >= 1 else ()) + (LEVEL_2 if self.log_level >= 2 else ())

    def gather(self, names: tuple[str, ...], reset: bool = True) -> torch.Tensor:
        """Collective: [world, len(names)] seconds of each rank since the last reset."""
        local = torch.tensor([self._timers[n].elapsed if n in self._timers else 0.0 for n in names],
                             dtype=torch.float64, device=self.device)
        if reset:
            for timer in self._timers.values():
                timer.elapsed = 0.0
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local.unsqueeze(0).cpu()
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)
        return torch.stack(rows).cpu()

    def report(self, iterations: int, reset: bool = True) -> tuple[str | None, dict[str, float]]:
        """Collective: (Megatron's text, {name: max ms per iteration}) for the timers that ran."""
        names = self.reported_names()
        if not names:
            return None, {}
        ms = self.gather(names, reset) * 1000.0 / max(iterations, 1)
        ran = [i for i, _ in enumerate(names) if bool((ms[:, i] > 0).any())]
        if not ran:
            return None, {}
        maxima = {names[i]: float(ms[:, i].max()) for i in ran}
        return format_timers(names, ms, ran, self.log_option), maxima


def format_timers(names: tuple[str, ...], ms: torch.Tensor, ran: list[int], option: str) -> str:
    if option == "all":
        lines = ["times across ranks (ms):"]
        for i in ran:
            lines.append(f"  {names[i]}:")
            lines += [f"     rank {rank:2d}: {float(ms[rank, i]):.2f}" for rank in range(ms.shape[0])
                      if ms[rank, i] > 0]
        return "\n".join(lines)
    lines = ["max time across ranks (ms):" if option == "max" else "(min, max) time across ranks (ms):"]
    for i in ran:
        times = ms[:, i][ms[:, i] > 0]  # ranks that never ran a timer (other stages) are left out
        label = (names[i] + " ").ljust(48, ".")
        lines.append(f"    {label}: {float(times.max()):.2f}" if option == "max" else
                     f"    {label}: ({float(times.min()):.2f}, {float(times.max()):.2f})")
    return "\n".join(lines)
