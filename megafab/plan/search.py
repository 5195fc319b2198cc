"""The layout search: every layout the config accepts for a model, global batch and device count,
what it needs in memory (plan.planner) and how long its step takes (plan.step_time), ranked.

A candidate (plan.layout_candidate: config field names, flags spelled from the schema) replaces the
user's layout flags; its Config is the resolved base config with those fields replaced, and
megafab.checks decides whether it is valid. Each candidate shown is rebuilt from its printed command
line, so the printed flags are ones that start.

Pruning never drops a candidate that could rank first: more recompute than the first of none,
selective, full that fits is slower by construction; SP off at TP > 1 only where SP cannot run; no
sharding only at DP x CP = 1 (where it equals the distributed optimizer); TP inside one node. MoE
candidates also vary EP (dividing the experts) and ETP (TP or 1). Ranking keeps each rank grid's
(TP, PP, CP, EP, ETP, DP) best setting, so the top K are K different grids.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

from megafab import checks
from megafab.arguments import config_from_args
from megafab.config import Config, ConfigError
from megafab.config.schema import SECTIONS
from megafab.layout import data_parallel_size, expert_data_parallel_size
from megafab.plan.layout_candidate import RECOMPUTE, SHARDING, LayoutCandidate, strip_layout_flags
from megafab.plan.planner import plan
from megafab.plan.step_time import Prediction, predict

GiB = 2.0**30

@dataclass
class Candidate:
    flags: list[str]
    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int
    dp: int
    etp: int
    micro_batch_size: int
    recompute: str
    sharding: str
    sequence_parallel: bool
    memory_gib: float
    host_gib: float
    prediction: Prediction

    @property
    def layout_key(self) -> tuple:
        """The rank grid; VPP, like the micro-batch size, is a setting of a grid's schedule."""
        return self.tp, self.pp, self.cp, self.ep, self.etp, self.dp

    def to_json(self) -> dict:
        p = self.prediction
        return {"flags": self.flags, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "cp": self.cp,
                "ep": self.ep, "etp": self.etp, "dp": self.dp, "micro_batch_size": self.micro_batch_size,
                "recompute": self.recompute, "sharding": self.sharding,
                "sequence_parallel": self.sequence_parallel, "memory_gib": round(self.memory_gib, 3),
                "host_gib": round(self.host_gib, 3), "step_time_s": p.step_time_s,
                "tokens_per_s": p.tokens_per_s, "tflops_per_gpu": p.tflops_per_gpu, "mfu": p.mfu,
                "breakdown": p.breakdown}


def _describe(cfg) -> tuple[str, str]:
    m, p = cfg.model, cfg.parallel
    recompute = m.recompute_granularity or "none"
    sharding = "fsdp2" if p.fully_sharded else \
        "distributed_optimizer" if p.use_distributed_optimizer else "none"
    return recompute, sharding


def evaluate(cfg, machine, flags: list[str], tp_comm_overlap: bool = False, kernels: str = "flash",
             stages=None, memo: dict | None = None, routing: str = "bound") -> Candidate:
    """Memory and step time of one finalized, valid config (stages: its plan, if made already;
    memo: step_time.stage_passes's)."""
    stages = stages or plan(cfg, kernels, routing)
    p = cfg.parallel
    recompute, sharding = _describe(cfg)
    return Candidate(
        flags=list(flags), tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
        vpp=p.virtual_pipeline_model_parallel_size or 1, cp=p.context_parallel_size,
        ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size, dp=p.data_parallel_size,
        micro_batch_size=cfg.training.micro_batch_size, recompute=recompute,
        sharding=sharding, sequence_parallel=p.sequence_parallel,
        memory_gib=_device_gib(stages), host_gib=_host_gib(stages),
        prediction=predict(cfg, machine, stages, tp_comm_overlap, memo))


def _device_gib(stages) -> float:
    return max(s.total_bytes for s in stages) / GiB


def _host_gib(stages) -> float:
    return max(s.host_bytes for s in stages) / GiB


def fits(stages, machine) -> bool:
    return _device_gib(stages) <= machine.device_memory_gib and _host_gib(stages) <= machine.host_memory_gib


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _expert_layouts(base: Config, world: int, tp: int, pp: int) -> list[dict]:
    """EP and ETP (candidate fields) of an MoE model's candidates at (TP, PP): EP dividing the
    experts, ETP = TP (unset) or 1, where the expert grid divides the world (the rules judge each
    one); a dense model has EP 1, ETP unset only."""
    experts = base.moe.num_experts
    if experts is None:
        return [{}]
    return [{"expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}
            for etp in ([None, 1] if tp > 1 else [None]) for ep in _divisors(experts)
            if expert_data_parallel_size(world, tp, pp, ep, etp) is not None]


def _layout(tp, pp, vpp, cp, sp, sharding, experts: dict, **more) -> LayoutCandidate:
    """The candidate of the search's loop values (vpp 1: not interleaved; sharding: a SHARDING name;
    experts: an _expert_layouts entry; more: other candidate fields)."""
    return LayoutCandidate(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           num_virtual_stages_per_pipeline_rank=vpp if vpp > 1 else None,
                           context_parallel_size=cp, sequence_parallel=sp, **experts, **SHARDING[sharding],
                           **more)


class _Builder:
    """Configs of candidates from the resolved base config's values (see the module docstring)."""

    # Values finalize derives from the layout; they are recomputed for every candidate.
    DERIVED = ("data_parallel_size", "world_size", "num_micro_batches",
               "virtual_pipeline_model_parallel_size", "padded_vocab_size", "fully_sharded")

    def __init__(self, base: Config, user_flags: list[str], world: int, routing: str = "bound"):
        self.base, self.world, self.routing = base, world, routing
        self.memo: dict = {}  # layer passes shared by the layouts of this one model
        self.section = {f.name: name for name, section in SECTIONS.items()
                        for f in dataclasses.fields(section)}
        reset = list(self.DERIVED)
        given = {f.split("=")[0] for f in user_flags}
        # defaults finalize derives from the layout's batch sizes unless the user set them
        reset += [name for flag, name in (("--ddp-bucket-size", "ddp_bucket_size"),
                                          ("--eval-micro-batch-size", "eval_micro_batch_size"),
                                          ("--eval-global-batch-size", "eval_global_batch_size"))
                  if flag not in given]
        if any(f.split("=")[0] == "--padded-vocab-size" for f in user_flags):
            reset.remove("padded_vocab_size")  # Megatron uses a given padded size as it is
        self.reset: dict[str, dict] = {name: {} for name in SECTIONS}  # {section: {field: None}}
        for name in reset:
            self.reset[self.section[name]][name] = None

    def build(self, cand: LayoutCandidate) -> Config | None:
        """The candidate's finalized config, or None where a rule refuses it."""
        changes = {section: dict(values) for section, values in self.reset.items()}
        for name, value in cand.values().items():
            changes[self.section[name]][name] = value
        sections = {name: getattr(self.base, name).replaced(**values) for name, values in changes.items()}
        cfg = Config(**sections).finalize(self.world)
        return None if checks.problems(cfg) else cfg


def _best_micro_batch(builder, machine, layout: LayoutCandidate, dp, gbs, micro_batch_sizes,
                      tp_comm_overlap, kernels):
    """((built, valid, fitting), fastest fitting candidate) over micro-batch sizes and recompute for one
    layout and sharding. No recompute is planned first: where it fits, it is the fastest; where
    not, full recompute: where even that does not fit, nothing does, nor at any larger
    micro-batch; then selective."""
    built = valid = fitting = 0
    best = None
    for mbs in micro_batch_sizes:
        if gbs and gbs % (mbs * dp):
            continue
        planned, valid_here = {}, 0
        for recompute in ("none", "full", "selective"):
            built += 1
            cand = layout.replaced(micro_batch_size=mbs, **RECOMPUTE[recompute])
            cfg = builder.build(cand)
            if cfg is None:
                continue
            valid, valid_here = valid + 1, valid_here + 1
            stages = plan(cfg, kernels, builder.routing)
            if fits(stages, machine):
                planned[recompute] = (cand, cfg, stages)
                if recompute == "none":
                    break
            elif recompute == "full":
                break
        if not planned:
            if valid_here:
                break  # valid but too big: larger micro-batches need more memory still
            continue
        recompute = next(r for r in RECOMPUTE if r in planned)
        cand, cfg, stages = planned[recompute]
        fitting += 1
        evaluated = evaluate(cfg, machine, cand.flags(), tp_comm_overlap, kernels, stages, builder.memo,
                             builder.routing)
        if best is None or evaluated.prediction.step_time_s < best.prediction.step_time_s:
            best = evaluated
    return (built, valid, fitting), best


@dataclass
class SearchResult:
    ranked: list[Candidate]  # best first, one per layout
    considered: int  # configs built
    valid: int  # configs the rules accepted
    fitting: int
    seconds: float


def search(user_argv: list[str], num_gpus: int, machine, top: int = 10, tp_comm_overlap: bool = False,
           kernels: str = "flash", micro_batch_sizes=(1, 2, 4, 8), routing: str = "bound") -> SearchResult:
    """routing: an MoE model's routed rows in the memory that must fit (planner.plan)."""
    start = time.perf_counter()
    user = strip_layout_flags(user_argv)
    # the model and training flags, checked once (at world 1 every layout rule holds)
    base = config_from_args(user + ["--micro-batch-size", "1", "--dry-run"], world_size=1)
    overlap_param_gather = "--overlap-param-gather" in user_argv
    builder = _Builder(base, user, num_gpus, routing)
    m, t = base.model, base.training
    gbs = t.global_batch_size
    best: dict[tuple, Candidate] = {}
    considered = valid = fitting = 0
    tps = [d for d in _divisors(num_gpus) if d <= machine.gpus_per_node and m.num_attention_heads % d == 0]
    for tp in tps:
        for cp in [d for d in _divisors(num_gpus // tp) if d <= 16]:
            for pp in [d for d in _divisors(num_gpus // (tp * cp)) if d <= m.num_layers]:
                dp = data_parallel_size(num_gpus, tp, cp, pp)
                if gbs and gbs % dp:
                    continue
                vpps = [1] + ([v for v in _divisors(m.num_layers // pp) if v > 1] if pp > 1 and
                              m.num_layers % pp == 0 else [])
                for vpp, experts in itertools.product(vpps, _expert_layouts(base, num_gpus, tp, pp)):
                    for sharding in ("distributed_optimizer", "fsdp2", "none"):
                        if sharding == "none" and dp * cp > 1:
                            continue
                        for sp in ([True, False] if tp > 1 else [False]):
                            layout = _layout(tp, pp, vpp, cp, sp, sharding, experts, overlap_param_gather=(
                                overlap_param_gather and sharding == "distributed_optimizer"))
                            counts, cand = _best_micro_batch(builder, machine, layout, dp, gbs,
                                                             micro_batch_sizes, tp_comm_overlap, kernels)
                            considered, valid = considered + counts[0], valid + counts[1]
                            fitting += counts[2]
                            if cand is None:
                                continue
                            key = cand.layout_key
                            if key not in best or \
                                    cand.prediction.step_time_s < best[key].prediction.step_time_s:
                                best[key] = cand
                            if counts[1]:
                                break  # SP off only where SP cannot run
    ranked = sorted(best.values(), key=lambda c: c.prediction.step_time_s)
    shown = []
    for cand in ranked:
        if len(shown) == top:
            break
        try:  # the exact command line must be accepted as it is printed
            cfg = config_from_args(user + cand.flags + ["--dry-run"], world_size=num_gpus)
        except ConfigError:
            continue
        shown.append(evaluate(cfg, machine, user + cand.flags, tp_comm_overlap, kernels, routing=routing))
    return SearchResult(shown, considered, valid, fitting, time.perf_counter() - start)


def every_valid_layout(user_argv: list[str], num_gpus: int, micro_batch_sizes=(1, 2, 4),
                       recomputes=tuple(RECOMPUTE), shardings=tuple(SHARDING), max_cp: int = 1):
    """[(exact flags, finalized Config)] of every layout the config accepts, without the search's
    pruning (benchmarks/layout_search.py runs them all)."""
    user = strip_layout_flags(user_argv)
    base = config_from_args(user + ["--micro-batch-size", "1", "--dry-run"], world_size=1)
    builder = _Builder(base, user, num_gpus)
    layers = base.model.num_layers
    out = []
    for tp in _divisors(num_gpus):
        for cp in [d for d in _divisors(num_gpus // tp) if d <= max_cp]:
            for pp in _divisors(num_gpus // (tp * cp)):
                vpps = [1] + ([v for v in _divisors(layers // pp) if v > 1 and pp > 1]
                              if layers % pp == 0 else [])
                for vpp, mbs, sharding, recompute, sp, experts in itertools.product(
                        vpps, micro_batch_sizes, shardings, recomputes, [False, True] if tp > 1 else [False],
                        _expert_layouts(base, num_gpus, tp, pp)):
                    cand = _layout(tp, pp, vpp, cp, sp, sharding, experts, micro_batch_size=mbs,
                                   **RECOMPUTE[recompute])
                    cfg = builder.build(cand)
                    if cfg is not None:
                        out.append((user + cand.flags(), cfg))
    return out


def candidate_from_flags(user_argv: list[str], num_gpus: int, machine, tp_comm_overlap: bool = False,
                         kernels: str = "flash", routing: str = "bound") -> Candidate:
    """The layout the user's flags give, evaluated."""
    cfg = config_from_args(list(user_argv) + ["--dry-run"], world_size=num_gpus)
    flags = [f for f in user_argv if f != "--dry-run"]
    return evaluate(cfg, machine, flags, tp_comm_overlap, kernels, routing=routing)
