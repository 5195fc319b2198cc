"""Megatron-LM HEAD's examples/gptoss/02_train.sh (d98e8a64dd, unchanged in tests/data/fixtures/
megatron_scripts/gptoss_02_train.sh) through `pretrain_gpt.py --dry-run`, run by bash itself with its
own options and a distributed-config file setting 4 GPUs (its README's distributed_config.env), its
`python -m torch.distributed.run` caught (tests/helpers/megatron_scripts.py): world 4 = PP 4.

As written, the one message refuses only FP8 (--fp8-format needs Transformer Engine on a GPU;
--fp8-param-gather, FP8 weights, needs it too); with --transformer-impl local and the FP8 flags (and
--moe-permute-fusion, TE's) taken out, every flag is honoured or announced as no effect, the
gpt-oss features are in the model config, and the planned parameters equal megatron-core's own
inventory (its GPTModel built on the meta device: 289,576,192). Megatron's formula
(theoretical_memory_usage.py) gives 239,243,776 (0.24B): it keys the GLU factor 3/2 on --swiglu
alone, so --quick-geglu's fc1 is counted f wide instead of 2f; with the factor on the gated unit the
formula gives megatron-core's count less the 12 x 64 learnable sinks it leaves out.
"""

import os
import subprocess
import sys

import pytest
import torch

from megafab.arguments import SPELLINGS, build_parser, config_from_args
from megafab.config import SECTIONS
from megafab.megatron_flags import NO_EFFECT, REFUSED
from megafab.model.te import te_available
from megafab.plan.planner import model_params
from tests.helpers.megatron_scripts import launch_script_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "data", "fixtures", "megatron_scripts")
WORLD = 4
MEGATRON_CORE_PARAMS = 289_576_192  # megatron-core 0.16.1's GPTModel for these flags (test below)
# On this CPU: FP8 needs TE on a GPU (it is checked before --transformer-impl transformer_engine's own rule)
FP8_PARAMS = [] if te_available() and torch.cuda.is_available() else \
    ["--fp8-param-gather needs Transformer Engine"]
FP8_HERE = FP8_PARAMS + (["--fp8-format needs transformer_engine"] if not te_available()
                         else [] if torch.cuda.is_available()
                         else ["--fp8-format needs a CUDA GPU"])
CPU_SWAPS = {"transformer_engine": "local"}
CPU_DROPS = {"--fp8-format": 1, "--fp8-param-gather": 0, "--moe-permute-fusion": 0}


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    work = tmp_path_factory.mktemp("gptoss")
    (work / "ckpt").mkdir()
    torchrun, args = launch_script_flags(
        os.path.join(FIXTURES, "gptoss_02_train.sh"),
        ["--checkpoint-path", str(work / "ckpt"), "--distributed-config-file",
         os.path.join(FIXTURES, "gptoss_distributed_config.env")], str(work))
    assert torchrun[:4] == ["--nproc_per_node", str(WORLD), "--nnodes", "1"]
    return args


def cpu_flags(flags):
    out, skip = [], 0
    for token in flags:
        if skip:
            skip -= 1
            continue
        if token in CPU_DROPS:
            skip = CPU_DROPS[token]
            continue
        out.append(CPU_SWAPS.get(token, token))
    return out


def dry_run(flags):
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "PYTHONPATH": ROOT}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--dry-run"],
                          capture_output=True, text=True, timeout=600, env=env)


def test_script_as_written_refuses_only_fp8_on_this_machine(flags):
    proc = dry_run(flags)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.count("megafab: error:") == 1
    problems = [line[4:] for line in proc.stderr.splitlines() if line.startswith("  - ")]
    for want in FP8_HERE:
        assert sum(want in p for p in problems) == 1, (want, problems)
    assert len(problems) == len(FP8_HERE), problems


def megatron_formula(cfg, gated: bool) -> int:
    """Megatron-LM HEAD's compute_weight_and_optimizer_memory total for this (MoE, GQA, RMSNorm,
    untied, no-bias) model; `gated`: its GLU factor 3/2, which it applies for --swiglu only."""
    m, moe = cfg.model, cfg.moe
    h, heads, groups, layers = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.num_layers
    factor = 1.5 if gated else 1.0
    attention = 2 * h * h * (1 + groups / heads) * (m.kv_channels * heads / h)
    experts = 2 * h * moe.moe_ffn_hidden_size * moe.num_experts * factor
    per_layer = attention + experts + 2 * h + h * moe.num_experts  # + 2 RMSNorms + the router
    return int(layers * per_layer + h + 2 * h * m.padded_vocab_size)


def test_script_on_cpu_plans_megatron_cores_parameters_with_the_gpt_oss_features(flags):
    flags = cpu_flags(flags)
    proc = dry_run(flags)
    assert proc.returncode == 0, proc.stderr
    assert "refused" not in proc.stderr + proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("parameters:"))
    assert line.split()[1] == "289.58M", line
    cfg = config_from_args(flags, world_size=WORLD, start_up=True)  # NullTokenizer's eod id: 128257 -> 128384
    m = cfg.model
    assert (m.quick_geglu, m.activation_func_clamp_value, m.glu_linear_offset) == (True, 7.0, 1.0)
    assert (m.window_size, m.window_attn_skip_freq, m.softmax_type) == ((127, 0), 2, "learnable")
    assert (m.position_embedding_type, m.rotary_scaling_factor) == ("yarn", 32.0)  # --enable-gpt-oss
    assert cfg.precision.disable_bf16_reduced_precision_matmul and cfg.moe.moe_per_layer_logging
    total, _ = model_params(cfg)
    assert total == MEGATRON_CORE_PARAMS
    sinks = m.num_layers * m.num_attention_heads
    assert megatron_formula(cfg, gated=True) == MEGATRON_CORE_PARAMS - sinks
    as_written = megatron_formula(cfg, gated=False)
    assert as_written == 239_243_776  # "0.24B"
    fc1_gate_halves = m.num_layers * cfg.moe.num_experts * m.hidden_size * cfg.moe.moe_ffn_hidden_size
    assert MEGATRON_CORE_PARAMS - sinks - as_written == fc1_gate_halves
    assert abs(total - megatron_formula(cfg, gated=True)) / total < 0.005


def test_megatron_cores_own_model_has_these_parameters():
    """megatron-core 0.16.1's GPTModel (local spec) of the script's model, built on the meta device."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.helpers.mcore_moe import megatron_moe_on_cpu

    with megatron_moe_on_cpu():
        config = TransformerConfig(
            num_layers=12, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=64, num_query_groups=8,
            kv_channels=8, gated_linear_unit=True, activation_func=quick_gelu,
            activation_func_clamp_value=7.0, glu_linear_offset=1.0, add_bias_linear=False,
            normalization="RMSNorm", num_moe_experts=4, moe_ffn_hidden_size=2048, moe_router_topk=2,
            softmax_type="learnable", window_size=(127, 0), window_attn_skip_freq=2,
            use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.bfloat16)
        with torch.device("meta"):
            model = GPTModel(config, get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm"),
                             vocab_size=128384, max_sequence_length=8192, position_embedding_type="rope",
                             share_embeddings_and_output_weights=False)
        assert sum(p.numel() for p in model.parameters()) == MEGATRON_CORE_PARAMS


def test_every_script_flag_is_honoured_or_announced(flags):
    parser = build_parser()
    fields = {f for section in SECTIONS.values() for f in section.__dataclass_fields__}
    spellings = {flag for entries in SPELLINGS.values() for flag, _, _ in entries}
    for token in cpu_flags(flags):
        if not token.startswith("--") or token in NO_EFFECT or token in spellings:
            continue
        assert token not in REFUSED, token
        action = parser._option_string_actions.get(token)
        assert action is not None, f"{token} is unknown to megafab"
        assert action.dest in fields, f"{token} parses into {action.dest!r}, which no config field holds"
