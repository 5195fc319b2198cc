"""--config / --yaml-cfg: TOML and YAML files give the configuration of the equivalent flags, the
command line overrides them, and every problem in a file is named with the file and key."""

import pytest

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from tests.helpers.flags import tiny_flags

FLAGS = tiny_flags(num_layers=2, hidden_size=64, seq_length=32) + [
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "3e-4",
    "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--swiglu", "--disable-bias-linear",
    "--norm-epsilon", "1e-6", "--mock-data", "--vocab-size", "128", "--tensor-model-parallel-size", "2",
    "--sequence-parallel", "--profile-ranks", "0", "1", "--no-mmap-bin-files"]

TOML = """
[model]
num_layers = 2
hidden_size = 32              # overridden on the command line
num_attention_heads = 4
seq_length = 32
swiglu = true
add_bias_linear = false
norm_epsilon = 1e-6
vocab_size = 128

[parallel]
tensor-model-parallel-size = 2
sequence_parallel = true

[training]
micro_batch_size = 2
global_batch_size = 8
train_iters = 10

[optimizer]
lr = 3e-4
min_lr = 1e-5
lr_decay_style = "cosine"

[data]
mock_data = true
mmap_bin_files = false

[logging]
profile_ranks = [0, 1]
"""

# Megatron's YAML layout: TransformerConfig names under language_model, ModelParallelConfig names
# under model_parallel, the rest at the top level (PyYAML reads 1e-6 as a string: accepted).
YAML = """
language_model:
  num_layers: 2
  hidden_size: 32
  num_attention_heads: 4
  activation_func: swiglu
  add_bias_linear: false
  layernorm_epsilon: 1e-6
model_parallel:
  tensor_model_parallel_size: 2
  sequence_parallel: true
seq_length: 32
micro_batch_size: 2
global_batch_size: 8
train_iters: 10
lr: 3.0e-4
min_lr: 1e-5
lr_decay_style: cosine
mock_data: true
vocab_size: 128
mmap_bin_files: false
profile_ranks: [0, 1]
"""


def resolved(argv):
    return config_from_args(argv, world_size=4).to_flat()


@pytest.mark.parametrize("name, text, flag", [("run.toml", TOML, "--config"),
                                              ("run.yaml", YAML, "--yaml-cfg")])
def test_file_plus_one_override_equals_the_flags(tmp_path, name, text, flag):
    path = tmp_path / name
    path.write_text(text)
    expected = resolved(FLAGS)
    got = resolved([flag, str(path), "--hidden-size", "64"])
    assert got == expected
    assert got["hidden_size"] == 64 and got["swiglu"] and not got["add_bias_linear"]
    assert resolved([f"{flag}={path}", "--hidden-size", "64"]) == expected


def test_later_file_overrides_earlier_and_flags_override_both(tmp_path):
    (tmp_path / "a.toml").write_text(TOML)
    (tmp_path / "b.yaml").write_text("lr: 1.0e-3\nseq_length: 16\n")
    got = resolved(["--config", str(tmp_path / "a.toml"), "--config", str(tmp_path / "b.yaml"),
                    "--seq-length", "24", "--hidden-size", "64"])
    assert (got["lr"], got["seq_length"], got["num_layers"]) == (1e-3, 24, 2)


def test_every_problem_names_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nnum_layerz = 2\nhidden_size = "wide"\nnormalization = "BatchNorm"\n'
                   'swiglu = 1\n[nonsense]\nx = 1\n[parallel]\nnum_distributed_optimizer_instances = 2\n'
                   'context_parallel_size = 1\n')
    with pytest.raises(ConfigError) as err:
        config_from_args(["--config", str(bad), "--config", str(tmp_path / "missing.yaml"),
                          "--config", str(tmp_path / "x.json")], world_size=1)
    text = str(err.value)
    assert f"{bad}: num_layerz: not a megafab flag (did you mean num_layers?)" in text
    assert f"{bad}: hidden_size: invalid literal for int()" in text
    assert f"{bad}: normalization: 'BatchNorm' is not one of LayerNorm, RMSNorm" in text
    assert f"{bad}: swiglu: expected true or false, got 1" in text
    assert f"{bad}: [nonsense] is not one of the tables" in text
    assert (f"{bad}: num_distributed_optimizer_instances: --num-distributed-optimizer-instances: "
            f"refused") in text
    assert "context_parallel_size" not in text  # a valid value
    assert f"{tmp_path / 'missing.yaml'}: no such config file" in text
    assert "x.json: a config file must be TOML (.toml) or YAML (.yaml, .yml)" in text


def test_unparsable_file_and_missing_value(tmp_path):
    (tmp_path / "broken.toml").write_text("num_layers = = 2\n")
    with pytest.raises(ConfigError, match=r"broken.toml: not valid TOML"):
        config_from_args(["--config", str(tmp_path / "broken.toml")], world_size=1)
    with pytest.raises(ConfigError, match=r"--config: expected one FILE"):
        config_from_args(["--config"], world_size=1)


def test_no_effect_flags_in_a_file_are_announced(tmp_path):
    text = TOML.replace("[model]\n", "[model]\nuse_mcore_models = true\n")
    (tmp_path / "a.toml").write_text(text)
    cfg = config_from_args(["--config", str(tmp_path / "a.toml")], world_size=4)
    assert any(n.startswith("--use-mcore-models (") and str(tmp_path / "a.toml") in n for n in cfg.no_effect)


def test_moe_layer_pattern_round_trips_through_a_file(tmp_path):
    """A pattern is written back as a TOML list (run_record's resolved config) and read as one."""
    flags = tiny_flags() + [
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1", "--mock-data",
        "--vocab-size", "128", "--lr", "1e-3", "--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*3)"]
    assert resolved(flags)["moe_layer_freq"] == (0, 1, 1, 1)
    (tmp_path / "moe.toml").write_text("moe_layer_freq = [0, 1, 1, 1]\n")
    assert resolved(flags[:-2] + ["--config", str(tmp_path / "moe.toml")])["moe_layer_freq"] == (0, 1, 1, 1)


def test_refused_flags_announced_or_off_values_in_a_file_act_as_on_the_command_line(tmp_path):
    """--rerun-mode validate_results (Megatron's default) is announced, disabled accepted silently,
    report_stats refused: the same in a file as in argv."""
    cases = (("validate_results", "announced"), ("disabled", "silent"), ("report_stats", "refused"))
    for value, outcome in cases:
        path = tmp_path / f"{value}.toml"
        path.write_text(TOML.replace("[model]\n", f'[model]\nrerun_mode = "{value}"\n'))
        if outcome == "refused":
            with pytest.raises(ConfigError, match=r"rerun_mode: --rerun-mode: refused"):
                config_from_args(["--config", str(path)], world_size=4)
            continue
        from_file = config_from_args(["--config", str(path)], world_size=4)
        notes = [n for n in from_file.no_effect if n.startswith("--rerun-mode")]
        base = tmp_path / "base.toml"
        base.write_text(TOML)
        argv = [n for n in config_from_args(["--config", str(base), "--rerun-mode", value],
                                            world_size=4).no_effect if n.startswith("--rerun-mode")]
        assert len(notes) == len(argv) == (1 if outcome == "announced" else 0), (notes, argv)
        if notes:
            assert str(path) in notes[0] and notes[0].startswith("--rerun-mode validate_results (")
