"""Activation recompute (Megatron's --recompute-* flags) on torch.utils.checkpoint, non-reentrant.

    full + uniform, n   layers of a model chunk are checkpointed in groups of n consecutive layers:
                        only each group's input [s(/tp), b, h] is kept, the rest is recomputed
    full + block, n     the first n layers of each chunk are checkpointed one by one, the others keep
                        their activations (fewer recomputes when memory allows)
    selective           the --recompute-modules (megatron-core 0.16.1's): core_attn (the SDPA call),
                        mlp (a dense MLP), moe (a whole MoE layer), shared_experts, checkpointed on
                        their inputs; layernorm (both norms), moe_act (the grouped experts'
                        activation), mla_up_proj (MLA's up projections + RoPE) discard their output
                        once used and refill it when backward reaches them (DiscardedOutput)

Dropout masks of a recomputed forward equal the original ones (every RNG stream is snapshot). With
TP/SP a recompute re-runs the region's collectives, every TP rank in the same backward order. A
forward's side effects (the router's counts and logs) happen once: modules ask recompute_phase().
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from megafab.distributed.random import checkpoint_rng_state, restore_rng_state
from megafab.errors import MegafabError

SUPPORTED_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


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
            out.append(f"--recompute-modules {' '.join(unsupported)}: not a module megatron-core recomputes "
                       f"(choices: {', '.join(SUPPORTED_MODULES)})")
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

    def selects(self, module: str) -> bool:
        """Whether selective recompute covers `module` (one of SUPPORTED_MODULES)."""
        return self.granularity == "selective" and module in self.modules

    @property
    def core_attention(self) -> bool:
        return self.selects("core_attn")

    @property
    def mla_up_proj(self) -> bool:
        """MLA's up projections and RoPE under a DiscardedOutput (read by the MLA layer)."""
        return self.selects("mla_up_proj")

    def model_problems(self, *, multi_latent_attention: bool, moe=None) -> list[str]:
        """Megatron's rules tying modules to the model: moe_act needs --moe-grouped-gemm,
        mla_up_proj --multi-latent-attention, shared_experts no --moe-shared-expert-overlap."""
        out = []
        grouped = moe is not None and moe.num_experts is not None and moe.moe_grouped_gemm
        if self.selects("moe_act") and not grouped:
            out.append("--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core recomputes the "
                       "grouped experts' activation only)")
        if self.selects("mla_up_proj") and not multi_latent_attention:
            out.append("--recompute-modules mla_up_proj needs --multi-latent-attention")
        if moe is not None and getattr(moe, "moe_layer_recompute", False) and self.granularity == "full":
            out.append("--moe-layer-recompute with --recompute-granularity full: Megatron refuses it (full "
                       "recompute already recomputes the MoE layer); drop one of them")
        if self.selects("shared_experts") and moe is not None and moe.moe_shared_expert_overlap and \
                moe.moe_shared_expert_intermediate_size is not None:
            out.append("--recompute-modules shared_experts cannot work with --moe-shared-expert-overlap")
        return out


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


class _Through(threading.local):
    """Another library's checkpoint in place of torch's, while a region asks for it (te.py: Transformer
    Engine's under FP8, so a recompute runs in the forward's FP8 state): checkpoint(fn, *args,
    contexts=...) and the (forward, recompute) contexts DiscardedOutput's two runs enter."""

    checkpoint = None
    region_contexts = None


_THROUGH = _Through()


@contextlib.contextmanager
def checkpoint_through(checkpoint_fn, region_contexts):
    """Inside: checkpointed() calls checkpoint_fn(fn, *args, contexts=pair) with megafab's own pair of
    (forward, recompute) contexts, and DiscardedOutput runs inside region_contexts()'s pair."""
    saved = _THROUGH.checkpoint, _THROUGH.region_contexts
    _THROUGH.checkpoint, _THROUGH.region_contexts = checkpoint_fn, region_contexts
    try:
        yield
    finally:
        _THROUGH.checkpoint, _THROUGH.region_contexts = saved


def checkpointed(fn, *args, tracker=None, device="cpu"):
    """fn(*args), keeping only the inputs for backward; the rest is recomputed with the same RNG:
    the CPU generator, the device generator and every tracker stream are snapshot before the
    original forward and put back around the recompute (afterwards the backward's states are
    restored, so later forwards draw on)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    snapshot = checkpoint_rng_state(tracker, device)

    def contexts():
        return _phase("forward"), _replay_rng(snapshot, tracker, device)
    if _THROUGH.checkpoint is not None:
        return _THROUGH.checkpoint(fn, *args, contexts=contexts)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, context_fn=contexts)


class _DiscardableRun(torch.autograd.Function):
    """fn(*inputs) run without autograd, keeping only the tensor inputs; its backward takes the
    recomputed graph DiscardedOutput built and returns the gradients of the inputs and `params`."""

    @staticmethod
    def forward(ctx, region, num_inputs, *inputs_and_params):
        inputs = inputs_and_params[:num_inputs]
        with region.contexts[0]:
            outputs = region.fn(*inputs)
        ctx.region = region
        ctx.others = [None if torch.is_tensor(t) else t for t in inputs]
        ctx.tensor_grad = [(torch.is_tensor(t), torch.is_tensor(t) and t.requires_grad) for t in inputs]
        ctx.save_for_backward(*(t for t in inputs if torch.is_tensor(t)))
        region.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        region = ctx.region
        if region.recomputed is None:  # backward reached the region before its hook tensor
            region.refill(None)
        inputs, outputs = region.recomputed
        region.recomputed = region.ctx = None
        wanted = [t for t in (*inputs, *region.params) if torch.is_tensor(t) and t.requires_grad]
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                    allow_unused=True) if pairs and wanted else [None] * len(wanted)
        by_id = {id(t): g for t, g in zip(wanted, found)}
        return (None, None, *(by_id.get(id(t)) if torch.is_tensor(t) else None
                              for t in (*inputs, *region.params)))


def eager(fn):
    """fn under --compile: a graph break, run eagerly (torch.compiler.disable). Applied at the first
    call, not at import: applying it imports torch._dynamo (seconds), which the planner's meta
    builds of the model never need."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


class DiscardedOutput:
    """megatron-core's output-discarding checkpoint (CheckpointWithoutOutput), for the layernorm,
    moe_act and mla_up_proj modules: a cheap region whose output is saved by the next op.

        region = DiscardedOutput(norm, norm)
        y = region(x)              # no graph inside the region; x is kept
        out = consumer(y)          # the consumer saves y for its backward
        region.discard(out)        # y's storage is freed (its metadata stays), until the gradient
                                   # of `out` arrives: then fn(x) is recomputed into y's storage

    Parameters fn uses must be passed (`params`) so their gradients reach the graph. fn must draw
    no random numbers. Outside training (no grad, `active` False) and inside a checkpointed
    region it is a plain call."""

    def __init__(self, fn, params=(), active: bool = True):
        """params: the parameters fn uses (a module: its parameters(), read when called)."""
        self.fn, self.params, self.active = fn, params, active
        self.ctx = self.outputs = self.recomputed = self.contexts = None

    @eager  # (--compile: a graph break; the region and its storage tricks run eagerly)
    def __call__(self, *inputs):
        # inside a checkpointed region (full recompute, moe) the region's tensors are not kept anyway,
        # and a freed storage there would be one the checkpoint hands to the original graph
        if not (self.active and torch.is_grad_enabled()) or recompute_phase() is not None:
            self.outputs = None
            return self.fn(*inputs)
        params = self.params
        self.params = tuple(params.parameters() if isinstance(params, torch.nn.Module) else params)
        through = _THROUGH.region_contexts
        self.contexts = through() if through else (contextlib.nullcontext(), contextlib.nullcontext())
        out = _DiscardableRun.apply(self, len(inputs), *inputs, *self.params)
        kept = {t.untyped_storage().data_ptr() for t in (*inputs, *self.params) if torch.is_tensor(t)}
        # an output viewing an input's (or a parameter's) storage is never freed
        self.outputs = [(i, o) for i, o in enumerate(out if isinstance(out, tuple) else (out,))
                        if o.untyped_storage().data_ptr() not in kept]  # (position, output)
        return out

    @eager
    def discard(self, hook_tensor: torch.Tensor) -> None:
        """Free the output's storage; the gradient of `hook_tensor` (computed in backward before any
        op that saved the output runs) recomputes it."""
        if self.outputs is None or not hook_tensor.requires_grad:
            return
        for _, out in self.outputs:
            out.untyped_storage().resize_(0)
        hook_tensor.register_hook(self.refill)

    def refill(self, _grad) -> None:
        if self.ctx is None or self.recomputed is not None:
            return
        ctx = self.ctx
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved).detach().requires_grad_(needs) if is_tensor else other
                  for other, (is_tensor, needs) in zip(ctx.others, ctx.tensor_grad)]
        with torch.enable_grad(), _phase("recompute"), self.contexts[1]:
            outputs = self.fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        with torch.no_grad():
            for i, kept in self.outputs or ():  # the recomputed values into the freed storages
                storage = outputs[i].untyped_storage()
                if kept.untyped_storage().nbytes() == 0:
                    kept.untyped_storage().resize_(storage.nbytes())
                    kept.untyped_storage().copy_(storage)
        self.outputs, self.recomputed = None, (inputs, outputs)


# recompute: checkpointed for a region inside a layer (the selective modules); under --compile it
# breaks the layer's graph and runs eagerly. Full recompute checkpoints whole (compiled) layers from
# outside them: forward_layers calls checkpointed itself.
recompute = eager(checkpointed)


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
            x = checkpointed(run(start, end), x, *layer_args, tracker=ctx.rng_tracker, device=ctx.device)
        else:
            x = run(start, end)(x, *layer_args)
    return x
