"""Megatron-LM HEAD's model bundles (examples/post_training/modelopt/conf at d98e8a6, copied to
tests/data/fixtures/megatron_scripts/modelopt_*.sh) for Llama-3.1-8B-Instruct, Llama-3.2-1B-Instruct,
Qwen2.5-7B-Instruct, Qwen3-8B, Qwen3-30B-A3B and gpt-oss-20b: their MODEL_ARGS as written plus batch,
LR, mock-data and save flags (the HF tokenizer as NullTokenizer with the model's vocabulary) pass
`--dry-run` on 8 ranks with nothing refused; the planned parameters are within 0.5% of Megatron's
formula (theoretical_memory_usage.py; for gpt-oss with its GLU factor on the gated unit, see
megatron_params), and the bundles' features are in the model config (the Llama bundles'
--use-rope-scaling; gpt-oss's clamped quick-GEGLU, biases, sinks, windows and --enable-gpt-oss's
YaRN). --padded-vocab-size is used as written (the NullTokenizer one id less, so that its
end-of-document id fits)."""

import os
import re
import subprocess
import sys

import pytest

from megafab.arguments import config_from_args
from megafab.model.activations import gated_linear_unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "data", "fixtures", "megatron_scripts")
VOCAB = {"Llama-3.1-8B-Instruct": 128256, "Llama-3.2-1B-Instruct": 128256, "Qwen2.5-7B-Instruct": 152064,
         "Qwen3-8B": 151936, "Qwen3-30B-A3B": 151936, "gpt-oss-20b": 201088}
EXTRA = ["--global-batch-size", "256", "--train-iters", "1000", "--lr", "1e-4", "--mock-data"]


def bundle_flags(name, tmp_path):
    """MODEL_ARGS as the bundle's unquoted use splits it, then the run's own flags."""
    path = os.path.join(FIXTURES, f"modelopt_{name}.sh")
    out = subprocess.run(["bash", "-c", f'source "{path}"; printf "%s\\n" $MODEL_ARGS'], capture_output=True,
                         text=True, check=True, timeout=30)
    flags = ["NullTokenizer" if t == "HuggingFaceTokenizer" else t for t in out.stdout.split()]
    vocab = VOCAB[name] - 1 if "--padded-vocab-size" in flags else VOCAB[name]
    return flags + EXTRA + ["--vocab-size", str(vocab), "--save", str(tmp_path / "ckpt")]


def dry_run(flags):
    env = {**os.environ, "WORLD_SIZE": "8", "PYTHONPATH": ROOT}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--dry-run"],
                          capture_output=True, text=True, timeout=600, env=env)


def megatron_params(cfg):
    """Megatron's compute_weight_and_optimizer_memory (it counts no linear biases but the router's, no
    QK-norm weights, no attention sinks): per layer 2h^2 (1 + g/a) kv a / h + 2h (norms) + the MLP,
    dense 2 h f x 1.5 (gated), MoE 2 h f_e E x 1.5 + h E (the router) + E (its bias); + h +
    embeddings. Megatron keys the factor 1.5 on --swiglu alone, so for --quick-geglu (gpt-oss) it
    counts fc1 f wide where megatron-core builds it 2f wide (its GPTModel; tests/
    test_megatron_gptoss_script.py builds one): here the factor goes with the gated unit."""
    m, moe = cfg.model, cfg.moe
    h, layers, heads, groups = m.hidden_size, m.num_layers, m.num_attention_heads, m.num_query_groups
    query_ratio = m.kv_channels * heads / h
    gated = 1.5 if gated_linear_unit(m) else 1.0
    if moe.num_experts is None:
        mlp = 2 * h * m.ffn_hidden_size * gated
    else:
        experts = moe.num_experts
        mlp = 2 * h * moe.moe_ffn_hidden_size * experts * gated + h * experts + experts * m.add_bias_linear
    per_layer = 2 * h * h * (1 + groups / heads) * query_ratio + mlp + 2 * h
    embeddings = m.padded_vocab_size * h * (2 if m.untie_embeddings_and_output_weights else 1)
    return layers * per_layer + h + embeddings


@pytest.mark.parametrize("name", sorted(VOCAB))
def test_bundle_dry_runs_with_nothing_refused(name, tmp_path):
    flags = bundle_flags(name, tmp_path)
    out = dry_run(flags)
    assert out.returncode == 0, out.stderr
    assert "refused" not in out.stderr + out.stdout
    cfg = config_from_args(flags, world_size=8)
    assert cfg.model.padded_vocab_size == VOCAB[name]
    planned = float(re.search(r"stage 0: params ([\d.]+)M", out.stdout).group(1)) * 1e6
    expected = megatron_params(cfg)
    assert abs(planned - expected) <= 0.005 * expected, (planned, expected)
    llama = name.startswith("Llama")
    assert cfg.model.use_rope_scaling == llama and cfg.model.rope_scaling_factor == 8.0
    assert cfg.model.add_qkv_bias == name.startswith("Qwen2")
    assert cfg.model.qk_layernorm == name.startswith("Qwen3")
    assert (cfg.moe.num_experts is not None) == (name in ("Qwen3-30B-A3B", "gpt-oss-20b"))
    gpt_oss = name == "gpt-oss-20b"
    m = cfg.model
    assert (m.quick_geglu, m.add_bias_linear, m.softmax_type == "learnable", m.window_size == (127, 0),
            m.position_embedding_type == "yarn", m.glu_linear_offset == 1.0) == (gpt_oss,) * 6
    assert m.activation_func_clamp_value == (7.0 if gpt_oss else None)
