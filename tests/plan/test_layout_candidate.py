"""The search's layout candidate: its flags are the schema's spellings, they parse to the config the
search built, and megafab.layout's grid sizes are the config's derived ones."""

import dataclasses
import itertools

import pytest

from megafab import checks
from megafab.arguments import build_parser, config_from_args
from megafab.config import Config
from megafab.config.schema import SECTIONS
from megafab.layout import Layout, LayoutError, layout_problems
from megafab.plan.layout_candidate import LAYOUT_FLAGS, NAMES, LayoutCandidate, strip_layout_flags
from megafab.plan.moe import expert_data_parallel_size, expert_sizes
from megafab.plan.search import _Builder, every_valid_layout

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "127", "--make-vocab-size-divisible-by", "32", "--global-batch-size", "8"]
MOE = MODEL + ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]
# a value other than the schema's default for every candidate field
CHANGED = LayoutCandidate(
    tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
    num_virtual_stages_per_pipeline_rank=2, context_parallel_size=2, expert_model_parallel_size=2,
    expert_tensor_parallel_size=1, micro_batch_size=4, sequence_parallel=True, use_distributed_optimizer=True,
    use_torch_fsdp2=True, overlap_param_gather=True, recompute_granularity="full", recompute_method="block",
    recompute_num_layers=2, recompute_modules=("core_attn", "mlp"))


def _options():
    """{flag: argparse action} of megafab-pretrain's parser."""
    return {opt: a for a in build_parser()._actions for opt in a.option_strings}


def test_every_field_is_a_config_field_and_its_flag_sets_that_field():
    options = _options()
    flags = CHANGED.flags()
    named = [t for t in flags if t.startswith("--")]
    assert [options[t].dest for t in named] == list(NAMES)  # one flag per field, in declaration order
    assert LayoutCandidate().flags() == ["--micro-batch-size", "1"]  # defaults print nothing
    parsed = vars(build_parser().parse_args(flags))
    assert {name: parsed[name] for name in NAMES} == {
        **CHANGED.values(), "recompute_modules": list(CHANGED.recompute_modules)}
    # every spelling of a candidate field is removed from the user's flags, and nothing else
    spelled = {opt for opt, a in options.items() if a.dest in NAMES}
    assert spelled <= set(LAYOUT_FLAGS)
    assert "--recompute-activations" in LAYOUT_FLAGS  # Megatron's shortcut for recompute selective
    user = ["--num-layers", "4", "--tensor-model-parallel-size=2", "--recompute-modules", "mlp", "moe",
            "--sequence-parallel", "--pipeline-model-parallel-size", "2", "--bf16", "--recompute-activations"]
    assert strip_layout_flags(user) == ["--num-layers", "4", "--bf16"]


def test_a_flag_that_cannot_say_the_value_is_refused():
    with pytest.raises(ValueError, match="tensor_model_parallel_size to None"):
        LayoutCandidate(tensor_model_parallel_size=None).flags()


@pytest.mark.parametrize("flags,world", [(MODEL, 4), (MOE, 4)])
def test_the_candidates_flags_parse_to_the_config_the_search_built(flags, world):
    layouts = every_valid_layout(flags, world, micro_batch_sizes=(1, 2), max_cp=2)
    assert len(layouts) > 20
    seen = set()
    for argv, built in layouts:
        parsed = config_from_args(argv + ["--dry-run"], world_size=world)
        assert parsed.to_flat() == built.to_flat(), argv
        p = built.parallel
        seen.add((p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                  p.expert_model_parallel_size, p.expert_tensor_parallel_size))
    assert len({s[:3] for s in seen}) >= 5
    if flags is MOE:  # EP > 1 and ETP != TP are among them
        assert any(s[3] > 1 for s in seen) and any(s[4] != s[0] for s in seen)


def test_a_search_only_setting_builds_what_its_flags_say():
    user = strip_layout_flags(MODEL)
    base = config_from_args(user + ["--micro-batch-size", "1", "--dry-run"], world_size=1)
    cand = LayoutCandidate(tensor_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=None,
                           micro_batch_size=2, use_distributed_optimizer=True, overlap_param_gather=True,
                           sequence_parallel=True)
    built = _Builder(base, user, 4).build(cand)
    parsed = config_from_args(user + cand.flags() + ["--dry-run"], world_size=4)
    assert built.parallel.overlap_param_gather and parsed.to_flat() == built.to_flat()
    assert _Builder(base, user, 3).build(cand) is None  # TP 2 on 3 ranks: the rules refuse it


def test_replaced_is_a_writable_copy_and_leaves_the_frozen_section_alone():
    cfg = config_from_args(MODEL + ["--micro-batch-size", "1", "--dry-run"], world_size=1)
    copy = cfg.parallel.replaced(tensor_model_parallel_size=2, data_parallel_size=None)
    assert type(copy) is type(cfg.parallel) and not copy.frozen and cfg.parallel.frozen
    assert (copy.tensor_model_parallel_size, cfg.parallel.tensor_model_parallel_size) == (2, 1)
    assert copy.data_parallel_size is None and cfg.parallel.data_parallel_size == 1
    copy.context_parallel_size = 2  # writable
    with pytest.raises(TypeError, match="no field tensor_parallel"):
        cfg.parallel.replaced(tensor_parallel=2)
    resolved = Config(**{name: getattr(cfg, name).replaced() for name in SECTIONS}).finalize(1)
    assert resolved.to_flat() == cfg.to_flat()


def _resolved(world, tp, cp, pp, ep, etp):
    cfg = Config()
    p = cfg.parallel
    p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size = tp, cp, pp
    p.expert_model_parallel_size, p.expert_tensor_parallel_size = ep, etp
    return cfg.finalize(world)


def test_the_layouts_sizes_are_the_configs_derived_ones():
    checked = refused = 0
    for world, tp, cp, pp, ep, etp in itertools.product((1, 2, 4, 6, 8), (1, 2, 4), (1, 2), (1, 2, 3),
                                                         (1, 2, 4), (None, 1, 2)):
        cfg = _resolved(world, tp, cp, pp, ep, etp)
        p = cfg.parallel
        assert p.expert_tensor_parallel_size == (tp if etp is None else etp)  # Megatron: ETP defaults to TP
        assert expert_sizes(cfg) == (ep, p.expert_tensor_parallel_size)
        problems = layout_problems(world, tp, pp, cp, ep, etp)
        dense_divides = world % (tp * cp * pp) == 0
        assert (p.data_parallel_size is not None) == dense_divides
        if problems:
            refused += 1
            with pytest.raises(LayoutError):
                Layout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
            resolved = layout_problems(world, tp, pp, cp, ep, p.expert_tensor_parallel_size)
            assert set(resolved) <= set(checks.problems(cfg))  # the rules say the same
            continue
        checked += 1
        layout = Layout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
        assert layout == Layout.of(p)
        assert (layout.dp, layout.etp, layout.edp) == (p.data_parallel_size, p.expert_tensor_parallel_size,
                                                      expert_data_parallel_size(cfg))
        assert layout.dp * tp * cp * pp == world == layout.edp * layout.etp * ep * pp
        assert layout.size("edp") == len(layout.groups("edp")[0])
    assert checked > 50 and refused > 50


def test_a_candidate_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CHANGED.micro_batch_size = 1
