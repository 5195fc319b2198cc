"""Activation recompute (Megatron's --recompute-* flags) on torch.utils.checkpoint, non-reentrant.

    full + uniform, n   layers of a model chunk are checkpointed in groups of n consecutive layers:
                        only each group's input [s(/tp), b, h] is kept, the rest is recomputed
    full + block, n     the first n layers of each chunk are checkpointed one by one, the others keep
                        their activations (fewer recomputes when memory allows)
    selective           only core attention (the SDPA call: scores, softmax, dropout, context) is
                        recomputed; q, k, v and its output are kept, the [b, heads, s, s] terms are not

Dropout masks of a recomputed forward equal the original ones (recompute snapshots every RNG
stream). With TP/SP the recompute re-runs the region's collectives; every TP rank walks the same
backward graph, so they recompute in the same order. A forward's side effects (the MoE router's
counts and logs) happen once per micro-batch: modules ask recompute_phase().
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from megafab.distributed.random import checkpoint_rng_state, restore_rng_state
from megafab.errors import MegafabError

SUPPORTED_MODULES = ("core_attn",)


class RecomputeConfigError(MegafabError):
    pass


@dataclass(frozen=True)
class RecomputeSettings:
    granularity: str | None = None  # None, "full" or "selective"
    method: str | None = None  # "uniform" or "block" with full
    num_layers: int | None = None
    modules: tuple[str, ...] = ()

    @classmethod
    def from_model_config(cls, cfg, check: bool = True) -> RecomputeSettings:
        """The settings of a ModelConfig's --recompute-* fields; check=True raises on a problem
        (the model builder's guard; the config check reports problems() before start)."""
        granularity = getattr(cfg, "recompute_granularity", None)
        modules = tuple(getattr(cfg, "recompute_modules", None) or ())
        if granularity == "selective" and not modules:
            modules = ("core_attn",)
        settings = cls(granularity, getattr(cfg, "recompute_method", None),
                       getattr(cfg, "recompute_num_layers", None), modules)
        problems = settings.problems() if check else []
        if problems:
            raise RecomputeConfigError("; ".join(problems))
        return settings

    def problems(self) -> list[str]:
        """Every reason these settings cannot run (pure: no model needed)."""
        out = []
        if self.method is not None and self.granularity != "full":
            out.append("--recompute-method needs --recompute-granularity full")
        unsupported = [m for m in self.modules if m not in SUPPORTED_MODULES]
        if unsupported:
            out.append(f"--recompute-modules {' '.join(unsupported)} not supported by megafab (supported: "
                       f"{', '.join(SUPPORTED_MODULES)}); use --recompute-modules core_attn or "
                       f"--recompute-granularity full")
        if self.modules and self.granularity != "selective":
            out.append("--recompute-modules needs --recompute-granularity selective")
        if self.granularity == "full":
            if self.method not in ("uniform", "block"):
                out.append("--recompute-granularity full needs --recompute-method uniform or block")
            if self.num_layers is None:
                out.append("--recompute-granularity full needs --recompute-num-layers")
            elif self.num_layers < 1:
                out.append(f"--recompute-num-layers {self.num_layers} must be at least 1 with "
                           f"--recompute-granularity full")
        return out

    @property
    def core_attention(self) -> bool:
        return self.granularity == "selective" and "core_attn" in self.modules


def layer_groups(num_layers: int, settings: RecomputeSettings) -> list[tuple[int, int, bool]]:
    """Split a chunk's layers into (start, end, recomputed) runs, positions local to the chunk."""
    if settings.granularity != "full":
        return [(0, num_layers, False)] if num_layers else []
    n = settings.num_layers
    if settings.method == "uniform":
        return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
    block = min(n, num_layers)
    groups = [(i, i + 1, True) for i in range(block)]
    return groups + ([(block, num_layers, False)] if block < num_layers else [])


class _Phase(threading.local):
    """The recompute phase of this thread (the backward of a CUDA tensor runs in a device thread;
    a recompute enters and leaves its phase in the thread that runs it)."""

    def __init__(self):
        self.stack: list[str] = []


_PHASE = _Phase()


def recompute_phase() -> str | None:
    """"forward" (a checkpointed first pass), "recompute" (its re-run) or None elsewhere.

    Side effects of a forward (the MoE router's balancing-loss log, its token counts for the expert
    bias and global_aux_loss's running counts) must happen once per micro-batch. megatron-core gets
    that from its reentrant checkpoint (the first forward runs under no_grad, where the router does
    none of them; the recompute does them). Here the first forward runs with autograd, so a module
    does the effect in "forward" (keeping what the recompute must see again) and replays it in
    "recompute", doing nothing new. Recomputes run in backward order, which per layer is the
    micro-batches' forward order in every schedule, so a FIFO per module pairs them."""
    return _PHASE.stack[-1] if _PHASE.stack else None


@contextlib.contextmanager
def _phase(name: str):
    _PHASE.stack.append(name)
    try:
        yield
    finally:
        _PHASE.stack.pop()


@contextlib.contextmanager
def _replay_rng(snapshot: dict, tracker, device):
    """During the recompute: the forward's RNG states; afterwards: the backward's again."""
    current = checkpoint_rng_state(tracker, device)
    restore_rng_state(snapshot, tracker, device)
    try:
        with _phase("recompute"):
            yield
    finally:
        restore_rng_state(current, tracker, device)


def recompute(fn, *args, tracker=None, device="cpu"):
    """fn(*args), keeping only the inputs for backward; the rest is recomputed with the same RNG:
    the CPU generator, the device generator and every tracker stream are snapshot before the
    original forward and put back around the recompute (afterwards the backward's states are
    restored, so later forwards draw on)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    snapshot = checkpoint_rng_state(tracker, device)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False,
                      context_fn=lambda: (_phase("forward"), _replay_rng(snapshot, tracker, device)))


def forward_layers(layers, x, settings: RecomputeSettings, ctx, *layer_args):
    """Run a chunk's layers in order, checkpointing the groups `settings` asks for."""
    layers = list(layers)

    def run(start, end):
        def segment(hidden, *extra):
            for layer in layers[start:end]:
                hidden = layer(hidden, *extra)
            return hidden
        return segment

    for start, end, recomputed in layer_groups(len(layers), settings):
        if recomputed and layers[0].training:
            x = recompute(run(start, end), x, *layer_args, tracker=ctx.rng_tracker, device=ctx.device)
        else:
            x = run(start, end)(x, *layer_args)
    return x
