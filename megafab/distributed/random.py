"""Random streams for tensor parallelism, on CPU or CUDA (Megatron's scheme).

    stream                 seed                               same across      differs across
    default                seed + 100*pp + 10007*cp           TP, DP ranks     PP stages, CP ranks
    'data-parallel-rng'    seed + 100*pp + 10007*cp           TP, DP ranks     PP stages, CP ranks
    'model-parallel-rng'   seed + 100*pp + 10007*cp + 2718 + tp    DP ranks    TP, CP ranks, PP stages

(pp, cp, tp: this rank's coordinates.) Dropout on activations replicated across TP draws from the
default stream, dropout on activations split across TP inside `tracker.fork()` (RNGStatesTracker).
The tracker works on the generator of one device (torch.default_generator for CPU, the CUDA
device's for CUDA); states are CPU ByteTensors on both, so checkpoints are portable. There is no
global tracker; the one made at initialize is passed to whatever needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"
TP_SEED_OFFSET = 2718
PP_SEED_STRIDE = 100
CP_SEED_STRIDE = 10007
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _DeviceRNG:
    """get/set/seed the default generator of one device; CUDA is touched only for a CUDA device."""

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"RNG device {self.device} is not supported; use a cpu or cuda device")

    def get_state(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def set_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)


class RNGStatesTracker:
    """Named RNG states that can be swapped in for a block of code (Megatron's CudaRNGStatesTracker).

        tracker = RNGStatesTracker(device)
        model_parallel_seed(1234, tp_rank, pp_rank, device, tracker)
        with tracker.fork():                      # the model-parallel stream
            probs = F.dropout(probs, p)

    Dropout on activations that are replicated across the TP group (after a RowParallelLinear, on
    the embedding, with sequence parallel off) draws from the default stream, so every TP rank drops
    the same elements. Dropout on activations split across TP ranks (attention probabilities of
    each rank's heads; anything in the sequence-parallel region) runs inside `fork()` so each rank
    draws its own mask. Context-parallel attention dropout takes one seed per call from a stream's
    host counter (host_seed: plain integer arithmetic, no tensor read back from the device); the
    counters are part of the RNG snapshot, so backward, recompute and a resumed checkpoint replay
    them.
    """

    def __init__(self, device="cpu"):
        self._rng = _DeviceRNG(device)
        self.reset()

    @property
    def device(self) -> torch.device:
        return self._rng.device

    def reset(self) -> None:
        """Forget every named state."""
        self._states: dict[str, torch.Tensor] = {}
        self._host: dict[str, list[int]] = {}  # name -> [seed, host draws so far]
        self._seeds: set[int] = set()

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed`, leaving the default stream untouched."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists; call reset() before re-seeding it")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG state; streams need distinct seeds")
        original = self._rng.get_state()
        self._rng.manual_seed(seed)
        self._states[name] = self._rng.get_state()
        self._rng.set_state(original)
        self._host[name] = [seed, 0]
        self._seeds.add(seed)

    def host_seed(self, name: str = MODEL_PARALLEL_RNG) -> int:
        """The next 62-bit seed of stream `name`'s host counter (no device work, no sync)."""
        if name not in self._host:
            raise ValueError(f"RNG state {name!r} was never added (known: {sorted(self._host)})")
        seed, draws = self._host[name]
        self._host[name][1] += 1
        return _splitmix64(_splitmix64(seed) ^ draws) >> 2

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every named state (CPU ByteTensors), e.g. for a checkpoint."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the named states with `states` (from get_states)."""
        self._states = {name: state.detach().cpu().clone() for name, state in states.items()}

    def get_host_draws(self) -> dict[str, list[int]]:
        """Every stream's host counter [seed, draws] (plain ints), for snapshots and checkpoints."""
        return {name: list(counter) for name, counter in self._host.items()}

    def set_host_draws(self, counters: dict[str, list[int]]) -> None:
        self._host.update({name: [int(c[0]), int(c[1])] for name, c in counters.items()})

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream `name`; afterwards it keeps its advance, the default is restored."""
        if name not in self._states:
            raise ValueError(f"RNG state {name!r} was never added (known: {sorted(self._states)}); "
                             f"call model_parallel_seed() or tracker.add() first")
        original = self._rng.get_state()
        self._rng.set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._rng.get_state()
            self._rng.set_state(original)


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int, device, tracker: RNGStatesTracker,
                        cp_rank: int = 0) -> dict:
    """Seed the default streams and (re)fill `tracker` per the table in this module's docstring.
    CP ranks hold different tokens, so every activation dropout differs across them: Megatron
    leaves CP out of the seeds (equal masks on different tokens), megafab does not. At CP 1 the
    seeds are Megatron's.

    The CPU generator is always seeded with the default seed (layers build their master weights
    on the CPU), and the CUDA device's generator too when `device` is a CUDA device. Returns the
    seeds used, by stream name ('default' for the default stream).
    """
    device = torch.device(device)
    if tracker.device.type != device.type:
        raise ValueError(f"the RNG tracker is on {tracker.device} but model_parallel_seed got device "
                         f"{device}; build the tracker with RNGStatesTracker({str(device)!r})")
    default_seed = seed + PP_SEED_STRIDE * pp_rank + CP_SEED_STRIDE * cp_rank
    tp_seed = default_seed + TP_SEED_OFFSET + tp_rank
    torch.default_generator.manual_seed(default_seed)
    if device.type == "cuda":
        _DeviceRNG(device).manual_seed(default_seed)
    tracker.reset()
    tracker.add(DATA_PARALLEL_RNG, default_seed)
    tracker.add(MODEL_PARALLEL_RNG, tp_seed)
    return {"default": default_seed, DATA_PARALLEL_RNG: default_seed, MODEL_PARALLEL_RNG: tp_seed}


def host_seed(tracker: RNGStatesTracker | None) -> int:
    """A dropout seed for context-parallel attention: the model-parallel stream's host counter, or
    (no tracker: single-process tools and tests) one draw of the CPU default generator."""
    if tracker is not None:
        return tracker.host_seed(MODEL_PARALLEL_RNG)
    return int(torch.randint(0, 1 << 62, (1,)).item())


def checkpoint_rng_state(tracker: RNGStatesTracker | None, device) -> dict:
    """Snapshot of the CPU stream, the device stream and every tracker stream (all CPU tensors).

    Activation recompute restores it before re-running a forward so dropout draws the same masks.
    """
    device = torch.device(device)
    return {"cpu": torch.get_rng_state(),
            "device": _DeviceRNG(device).get_state() if device.type == "cuda" else None,
            "tracker": tracker.get_states() if tracker is not None else None,
            "host_draws": tracker.get_host_draws() if tracker is not None else None}


def restore_rng_state(state: dict, tracker: RNGStatesTracker | None, device) -> None:
    """Put back a snapshot from checkpoint_rng_state."""
    device = torch.device(device)
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and state["device"] is not None:
        _DeviceRNG(device).set_state(state["device"])
    if tracker is not None:
        tracker.set_states(state["tracker"])
        if state.get("host_draws"):  # absent from snapshots made before host counters
            tracker.set_host_draws(state["host_draws"])
