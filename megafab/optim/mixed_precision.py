"""AdamW (or SGD) with fp32 main parameters for bf16/fp16 models, grad clipping and loss scaling.

MixedPrecisionOptimizer.step() runs Megatron's order: main grads from the model's, fp16 unscale
and inf/nan check (skip the step when found), the global L2 norm over every shard counted once and
clipping to `clip_grad`, torch AdamW (or SGD) on the main params, and the mains copied back into
the model dtype. For fp32/fp64 models the main param *is* the model param (no copy). The
distributed optimizer and FSDP2's optimizer are this class over their shards (MainParam); with
optimizer CPU offload a share of the entries keeps its mains and optimizer state on the host
(megafab.optim.cpu_offload).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from megafab.distributed.data_parallel import is_expert_param
from megafab.errors import MegafabError
from megafab.model.fp8_params import dequantized, is_fp8_param
from megafab.optim import clip_grads
from megafab.optim.cpu_offload import HostOptimizer, OffloadConfig, split_for_offload
from megafab.optim.grad_scaler import ConstantGradScaler

LOW_PRECISION = (torch.float16, torch.bfloat16)


class OptimizerConfigError(MegafabError):
    """An optimizer setting that cannot work; the message names the value, the rule and the fix."""


class NonFiniteGradError(FloatingPointError):
    """A nan/inf loss or grad norm under bf16/fp32, where there is no loss scaler to skip the step."""


def no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Megatron's rule: biases and 1-D params (norm weights) get no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


@dataclass
class MainParam:
    """One tensor the optimizer steps: a model param (or its shard) and its fp32/main copy."""

    name: str
    model_param: nn.Parameter
    main: torch.Tensor
    weight_decay: bool
    param_range: tuple[int, int] | None = None  # flat [lo, hi) of the model param (shards only)
    host: bool = False  # main and optimizer state offloaded to host memory

    @property
    def is_copy(self) -> bool:
        return self.main.untyped_storage().data_ptr() != self.model_values().untyped_storage().data_ptr()

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the model computes (and a checkpoint stores its weights) in."""
        return self.model_param.dtype

    @functools.cached_property
    def fp8(self) -> bool:
        """The model param is a TE FP8 weight (--fp8-param-gather): written by TE's cast, not copy_
        (asked every step: looked up once)."""
        return is_fp8_param(self.model_param)

    @property
    def has_master(self) -> bool:
        """Whether the main is a higher-precision master of the weights (bf16/fp16 models, FP8
        weights)."""
        return self.main.dtype != self.model_dtype or self.fp8

    @property
    def grad_dtype(self) -> torch.dtype:
        grad = self.model_grad()
        return grad.dtype if grad is not None else self.model_param.dtype

    def model_grad(self) -> torch.Tensor | None:
        grad = getattr(self.model_param, "main_grad", None)
        if grad is None:
            grad = self.model_param.grad
        if grad is None or self.param_range is None:
            return grad
        lo, hi = self.param_range
        return grad.view(-1)[lo:hi]

    def model_values(self) -> torch.Tensor:
        data = dequantized(self.model_param) if self.fp8 else self.model_param.detach()
        if self.param_range is None:
            return data
        lo, hi = self.param_range
        return data.view(-1)[lo:hi]


def named_model_params(model_chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(name, param) of every trainable param; DDP's 'module.' is dropped, chunks prefixed when > 1."""
    out = []
    for i, chunk in enumerate(model_chunks):
        inner = getattr(chunk, "module", chunk)  # DDP / FSDP wrappers hold the chunk
        prefix = f"chunk{i}." if len(model_chunks) > 1 else ""
        out += [(prefix + n, p) for n, p in inner.named_parameters() if p.requires_grad]
    return out


def make_torch_optimizer(name: str, groups: list[dict], lr: float, betas, eps: float,
                         sgd_momentum: float) -> torch.optim.Optimizer:
    """torch AdamW (adam: decoupled weight decay, as Megatron) or torch SGD (sgd: L2 weight decay
    added to the gradient, then momentum), fused where the device supports it."""
    if name == "sgd":
        make = functools.partial(torch.optim.SGD, groups, lr=lr, momentum=sgd_momentum)
    elif name == "adam":
        make = functools.partial(torch.optim.AdamW, groups, lr=lr, betas=betas, eps=eps)
    else:
        raise OptimizerConfigError(f"--optimizer {name!r} is not adam or sgd")
    try:
        return make(fused=True)
    except (RuntimeError, ValueError):
        return make()


def param_groups(entries: list[MainParam], weight_decay: float, decoupled_lr: float | None = None,
                 decoupled_min_lr: float | None = None) -> list[dict]:
    """Megatron's groups: weight decay or not (biases, 1-D params), and with --decoupled-lr the
    embedding/output-layer params on their own schedule (the group's max_lr / min_lr)."""
    groups: dict[tuple[bool, bool], dict] = {}
    for e in entries:
        decoupled = decoupled_lr is not None and \
            getattr(e.model_param, "is_embedding_or_output_parameter", False)
        key = (e.weight_decay, decoupled)
        if key not in groups:
            group = {"params": [], "weight_decay": weight_decay if e.weight_decay else 0.0,
                     "wd_mult": 1.0 if e.weight_decay else 0.0, "lr_mult": 1.0}
            if decoupled:
                group["max_lr"] = decoupled_lr
                if decoupled_min_lr is not None:
                    group["min_lr"] = decoupled_min_lr
            groups[key] = group
        groups[key]["params"].append(e.main)
    return [groups[k] for k in sorted(groups, key=lambda k: (not k[0], k[1]))]


class MixedPrecisionOptimizer:
    """AdamW over fp32 main params of this rank's model chunks (see the module docstring).

    topology: the Topology (None for a single process); supplies tp_rank, stage and the groups the
    norm and inf checks reduce over.
    clip_grad: max global L2 norm (Megatron's --clip-grad, default 1.0); 0 disables clipping (the
    norm is still computed and returned).
    grad_scaler: a ConstantGradScaler / DynamicGradScaler for fp16, None otherwise.
    cpu_offload: an OffloadConfig to keep that share of the main params and optimizer state on the
    host.
    """

    shards_across_dp = False  # each DP rank steps a disjoint shard (distributed optimizer, FSDP2)

    def __init__(self, model_chunks: list[nn.Module] | nn.Module, *, topology=None, lr: float = 1e-3,
                 weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 clip_grad: float = 1.0, grad_scaler: ConstantGradScaler | None = None,
                 log_num_zeros_in_grad: bool = False, raise_on_non_finite: bool = True,
                 optimizer: str = "adam", sgd_momentum: float = 0.9, decoupled_lr: float | None = None,
                 decoupled_min_lr: float | None = None, cpu_offload: OffloadConfig | None = None):
        if isinstance(model_chunks, nn.Module):
            model_chunks = [model_chunks]
        self.model_chunks = list(model_chunks)
        self.topology = topology
        self.clip_grad = clip_grad
        self.grad_scaler = grad_scaler
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.raise_on_non_finite = raise_on_non_finite
        self.iteration = 0
        named = named_model_params(self.model_chunks)
        if not named:
            raise OptimizerConfigError("the optimizer got no trainable parameters; build the model first")
        fp16 = any(p.dtype == torch.float16 for _, p in named)
        if fp16 and grad_scaler is None:
            raise OptimizerConfigError(
                "an fp16 model needs a loss scaler; pass DynamicGradScaler() (--fp16) or "
                "ConstantGradScaler(s) (--loss-scale s), or train in bf16")
        self.device = named[0][1].device
        self.entries = self._build_entries(named)
        self.optimizer_name = optimizer
        self.sgd_momentum = sgd_momentum
        self._hyper = dict(name=optimizer, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                           sgd_momentum=sgd_momentum, decoupled_lr=decoupled_lr,
                           decoupled_min_lr=decoupled_min_lr)
        on_device, self.host = self.entries, None
        if cpu_offload is not None:
            on_host, on_device = split_for_offload(self.entries, cpu_offload.fraction)
            self.host = HostOptimizer(on_host, self._make_torch_optimizer, cpu_offload, self.device)
        self.device_entries = on_device
        self.optimizer = self._make_torch_optimizer(on_device) if on_device else None
        self._optimizer_of = {id(main): o for o in self.torch_optimizers
                              for g in o.param_groups for main in g["params"]}

    def _make_torch_optimizer(self, entries: list[MainParam]) -> torch.optim.Optimizer:
        """The torch optimizer over `entries`' mains, in Megatron's param groups."""
        h = self._hyper
        groups = param_groups(entries, h["weight_decay"], h["decoupled_lr"], h["decoupled_min_lr"])
        return make_torch_optimizer(h["name"], groups, h["lr"], h["betas"], h["eps"], h["sgd_momentum"])

    # ---- what this rank steps -----------------------------------------------------------------
    def _build_entries(self, named) -> list[MainParam]:
        entries = []
        for name, p in named:
            main = p.detach().float().clone() if p.dtype in LOW_PRECISION else p
            entries.append(MainParam(name, p, main, not no_weight_decay(name, p)))
        return entries

    def _norm_groups(self, expert: bool = False) -> list:
        """Groups over which ranks hold disjoint grads (megafab.optim.clip_grads): model parallel
        (TP x PP; for expert params ETP x EP x PP), or, when every rank steps its own shard, the
        sharding group (DP x CP) then TP x PP: the whole world, for either kind."""
        if self.topology is None:
            return [self.model_chunks[0].dp_group] if self.shards_across_dp else []
        if self.shards_across_dp:
            return [self.topology.group("dp", "cp"), self.topology.group("tp", "pp")]
        if expert:
            return [self.topology.group("etp", "ep", "pp")]
        return [self.topology.group("tp", "pp")]

    def _grad_sets(self, entries: list[MainParam], grads: list[torch.Tensor],
                   host_entries: list[MainParam] = (), host_grads: list[torch.Tensor] = ()
                   ) -> list[clip_grads.GradSet]:
        """The grads by the groups their statistics reduce over: dense, and expert params when
        their groups differ (the same groups on every rank, so every rank takes part in each
        set's reductions, also one that holds no expert params: a pipeline stage without MoE)."""
        dense, expert = self._norm_groups(), self._norm_groups(expert=True)
        sets = {False: clip_grads.GradSet([], dense), True: clip_grads.GradSet([], expert)}
        split = expert != dense
        for e, g in zip(entries, grads):
            sets[split and is_expert_param(e.model_param)].grads.append(g)
        for e, g in zip(host_entries, host_grads):
            sets[split and is_expert_param(e.model_param)].scaled.append(g)
        return [sets[False], sets[True]] if split else [sets[False]]

    @property
    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The device optimizer (if any entry stays there) and the host pieces' optimizers."""
        return ([self.optimizer] if self.optimizer is not None else []) + \
            (self.host.torch_optimizers if self.host is not None else [])

    def torch_optimizer_of(self, entry: MainParam) -> torch.optim.Optimizer:
        """The torch optimizer that steps (and keeps the state of) `entry`."""
        return self._optimizer_of[id(entry.main)]

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The per-parameter tensors the torch optimizer keeps (what a checkpoint stores)."""
        if self.optimizer_name == "sgd":
            return ("momentum_buffer",) if self.sgd_momentum != 0 else ()
        return ("exp_avg", "exp_avg_sq")

    @property
    def param_groups(self) -> list[dict]:
        """The torch param groups (the LR scheduler writes lr / weight_decay here)."""
        return [g for o in self.torch_optimizers for g in o.param_groups]

    # ---- the step -----------------------------------------------------------------------------
    def _load_main_grads(self) -> list[torch.Tensor]:
        grads = []
        for e in self.device_entries:
            g = e.model_grad()
            if g is None:
                g = torch.zeros_like(e.main)
            e.main.grad = g if g.dtype == e.main.dtype else g.to(e.main.dtype)
            grads.append(e.main.grad)
        return grads

    def _drop_main_grads(self):
        for e in self.entries:
            e.main.grad = None

    def _copy_main_to_model(self):
        with torch.no_grad():
            for e in self.device_entries:
                if not e.fp8 and e.is_copy:  # FP8 weights: TE's cast, below
                    e.model_values().copy_(e.main)
        if self.shards_across_dp:  # TE's cast of this rank's FP8 mains into its shards: collective,
            fp8 = {e.model_param: e.main for e in self.device_entries if e.fp8}  # with or without any
            for chunk in self.model_chunks:
                chunk.cast_fp8_shards(fp8)

    def _counted(self, entries: list[MainParam], grads: list[torch.Tensor]
                 ) -> tuple[list[MainParam], list[torch.Tensor]]:
        kept = [(e, g) for e, g in zip(entries, grads)
                if clip_grads.counts_for_norm(e.model_param, self.topology)]
        return [e for e, _ in kept], [g for _, g in kept]

    @torch.no_grad()
    def params_norm(self, fp16: bool) -> float:
        """Megatron's calc_params_l2_norm (--log-params-norm), collective over every rank: the L2 norm
        of all parameters, each value once (the entries the gradient norm counts, reduced over the
        same groups), from the fp32 main parameters (fp16: the model's own values, as Megatron reads
        them)."""
        def values(entries):
            return self._counted(entries, [e.model_values().float() if fp16 else e.main for e in entries])

        host = self.host.entries if self.host is not None else []
        return clip_grads.global_grad_norm(self._grad_sets(*values(self.device_entries), *values(host)),
                                           self.device)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """One optimizer step; returns (update_successful, grad_norm, num_zeros_in_grad).

          1. main grads: each main param's `.grad` is its model param's `main_grad` (DDP buffer) or
             `.grad`, cast to the main dtype if needed;
          2. fp16 only: unscale by 1/loss_scale, look for inf/nan on every rank; if found, update
             the scaler and skip the step (model and main params untouched) -> (False, None, None);
          3. global L2 norm over all TP/PP(/DP) shards, each value counted once (expert params'
             over their own groups, clip_grads.py); clip to `clip_grad`; a non-finite norm without
             a loss scaler (bf16/fp32) raises NonFiniteGradError naming the iteration (parameters
             untouched), unless `raise_on_non_finite=False`, then the step is skipped;
          4. optional count of zeros;
          5. torch AdamW, or torch SGD with --optimizer sgd (fused where the device supports it),
             on the main params;
          6. main params copied back into the model dtype.
        Offloaded entries: steps 2-4 read their gradients where backward left them (the device),
        and the host applies 1/loss scale x the clip coefficient to its own fp32 copies before its
        own step (5, the same torch optimizer on the CPU), which also writes the weights back (6).
        """
        self.iteration += 1
        grads = self._load_main_grads()
        # Offloaded entries: their gradients where backward left them, still loss-scaled.
        host_grads = self.host.device_grads() if self.host is not None else []
        host_entries = self.host.entries if self.host is not None else []
        inv_scale = 1.0
        if self.grad_scaler is not None:
            inv_scale = 1.0 / self.grad_scaler.scale
            for g in grads:
                g.mul_(inv_scale)
            every = self._grad_sets(self.device_entries, grads, host_entries, host_grads)
            found_inf = clip_grads.found_non_finite(every, self.device)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self._drop_main_grads()
                return False, None, None
        counted = self._grad_sets(*self._counted(self.device_entries, grads),
                                  *self._counted(host_entries, host_grads))
        grad_norm = clip_grads.global_grad_norm(counted, self.device, scale=inv_scale)
        if not math.isfinite(grad_norm):
            self._drop_main_grads()
            if self.raise_on_non_finite:
                raise NonFiniteGradError(
                    f"iteration {self.iteration}: the gradient norm is {grad_norm} and no loss scaler "
                    f"can skip the step (bf16/fp32); parameters were left unchanged. Lower --lr, "
                    f"raise --lr-warmup-samples, or resume from an earlier checkpoint")
            return False, grad_norm, None
        clip = 1.0
        if self.clip_grad > 0:
            clip = clip_grads.clip_grads_by_norm(grads, self.clip_grad, grad_norm)
        num_zeros = None
        if self.log_num_zeros_in_grad:
            num_zeros = clip_grads.count_zeros(counted, self.device)
        if self.optimizer is not None:
            self.optimizer.step()
        if self.host is not None:
            self.host.step(inv_scale * clip, host_grads)
        self._copy_main_to_model()
        self._drop_main_grads()
        return True, grad_norm, num_zeros

    def zero_grad(self):
        """Zero the model grads of every chunk (DDP buffers, or .grad of plain modules)."""
        for chunk in self.model_chunks:
            if hasattr(chunk, "zero_grad_buffer"):  # DDP's buffer, FSDP2's sharded grads
                chunk.zero_grad_buffer()
            else:
                chunk.zero_grad(set_to_none=True)
