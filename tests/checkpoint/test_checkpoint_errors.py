"""A foreign, empty or partial checkpoint never reads as an empty model: each is refused naming what
was found and what was expected; Megatron's --ckpt-format rule and the model-args check, one line
per mismatch."""

import argparse
import os

import pytest
import torch

from megafab.checkpoint import CheckpointError, formats
from megafab.checkpoint.checkpointing import open_source
from megafab.checkpoint.megatron_args import model_arg_mismatches
from megafab.config import ConfigError
from megafab.convert import write_checkpoint
from megafab.convert.checkpoint import read_checkpoint
from megafab.model.gpt import GPTModel
from tests.helpers.tiny import LLAMA_STYLE, context, tiny_config


def _written(tmp_path, ckpt_format, tp=1):
    cfg = tiny_config(style=LLAMA_STYLE)
    model = GPTModel(cfg.model, context(dtype=torch.float32))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    root = str(tmp_path / ckpt_format)
    write_checkpoint(root, sd, cfg, ckpt_format=ckpt_format, tp=tp)
    return root, os.path.join(root, "iter_0000000"), cfg


def _open(root, cfg):
    return open_source(formats.find_checkpoint(root), cfg.model)


def test_a_complete_checkpoint_of_each_format_opens(tmp_path):
    for fmt in formats.CKPT_FORMATS:
        root, _, cfg = _written(tmp_path, fmt)
        source = _open(root, cfg)
        assert source.format == fmt and "model.decoder.layers.3.mlp.linear_fc1.weight" in source.stored


def test_a_torch_dist_checkpoint_missing_a_data_file_is_refused(tmp_path):
    root, path, cfg = _written(tmp_path, "torch_dist")
    [data] = [f for f in os.listdir(path) if f.endswith(".distcp")]
    os.remove(os.path.join(path, data))
    with pytest.raises(CheckpointError, match=f"incomplete.*{data} are missing"):
        _open(root, cfg)
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(CheckpointError, match="has no .metadata"):
        _open(root, cfg)


def test_a_legacy_checkpoint_missing_a_rank_is_refused(tmp_path):
    root, path, cfg = _written(tmp_path, "torch", tp=2)
    os.remove(os.path.join(path, "mp_rank_01", "model_optim_rng.pt"))
    with pytest.raises(CheckpointError, match="saved at TP 2 x PP 1 but mp_rank_01"):
        _open(root, cfg)


def test_a_torch_dist_without_model_tensors_is_refused(tmp_path):
    from megafab.checkpoint import dcp_io, megatron_dist
    from megafab.checkpoint.layout import Shard

    path = tmp_path / "iter_0000003"
    dcp_io.save_shards({"optimizer.state.exp_avg.x": Shard.whole(torch.zeros(2))}, str(path))
    megatron_dist.write_common(str(path), {"args": argparse.Namespace(num_layers=4), "iteration": 3})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(CheckpointError, match="without model weights"):
        _open(str(tmp_path), tiny_config())
    with pytest.raises(CheckpointError, match="without model weights"):
        read_checkpoint(str(tmp_path))


@pytest.mark.parametrize("files, found", [
    ([], "holds nothing"),
    (["model.safetensors", "config.json"], "holds config.json, model.safetensors"),
])
def test_foreign_or_empty_directories_name_what_was_found(tmp_path, files, found):
    path = tmp_path / "iter_0000001"
    path.mkdir()
    for name in files:
        (path / name).write_bytes(b"")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(CheckpointError) as info:
        formats.find_checkpoint(str(tmp_path))
    assert found in str(info.value) and "metadata.json + DCP files (Megatron torch_dist)" in str(info.value)


def test_ckpt_format_torch_expects_legacy_unless_auto_detect(tmp_path):
    root, _, _ = _written(tmp_path, "torch_dist")
    found = formats.find_checkpoint(root)
    with pytest.raises(CheckpointError, match="torch expects the legacy.*--auto-detect-ckpt-format"):
        formats.check_requested_format(found, "torch", auto_detect=False)
    formats.check_requested_format(found, "torch", auto_detect=True)
    formats.check_requested_format(found, "torch_dist", auto_detect=False)
    legacy = formats.find_checkpoint(_written(tmp_path, "torch")[0])
    formats.check_requested_format(legacy, "torch", auto_detect=False)


def test_each_model_arg_mismatch_is_one_line():
    m = tiny_config(style=LLAMA_STYLE).model
    saved = dict(num_layers=m.num_layers, hidden_size=64, num_attention_heads=m.num_attention_heads,
                 group_query_attention=False, num_query_groups=None, swiglu=False, normalization="RMSNorm",
                 qk_layernorm=True, apply_layernorm_1p=False, multi_latent_attention=True,
                 dropout_is_not_compared=0.3)
    lines = model_arg_mismatches(saved, m)
    assert lines == ["--hidden-size: checkpoint 64, this run 32",
                     f"--num-query-groups: checkpoint {m.num_attention_heads}, this run 2",
                     "--swiglu: checkpoint False, this run True",
                     "--qk-layernorm: checkpoint True, this run False",
                     "--multi-latent-attention: checkpoint True, this run False"]
    assert model_arg_mismatches(argparse.Namespace(num_layers=m.num_layers), m) == []
    # Megatron's validate_args sets add_qkv_bias with add_bias_linear; megafab derives the same bias
    gpt2 = tiny_config().model
    saved = dict(add_bias_linear=True, add_qkv_bias=True, apply_query_key_layer_scaling=True,
                 rotary_interleaved=False)
    assert model_arg_mismatches(saved, gpt2) == []


def test_unsupported_ckpt_formats_and_legacy_optimizer_saves_are_config_errors():
    with pytest.raises(ConfigError, match="--ckpt-format 'torch_dcp' is not supported"):
        tiny_config(ckpt_format="torch_dcp")
    with pytest.raises(ConfigError, match="--ckpt-format torch .* add --no-save-optim"):
        tiny_config(ckpt_format="torch", save="/tmp/x")
    cfg = tiny_config(ckpt_format="torch", save="/tmp/x", no_save_optim=True)
    assert cfg.checkpoint.ckpt_format == "torch"


def test_converting_a_checkpoint_without_args_names_the_fix(tmp_path):
    from megafab.checkpoint import dcp_io, megatron_dist
    from megafab.checkpoint.layout import Shard

    path = tmp_path / "iter_0000001"
    dcp_io.save_shards({"embedding.word_embeddings.weight": Shard.whole(torch.zeros(8, 4))}, str(path))
    megatron_dist.write_common(str(path), {})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(CheckpointError, match="records no args"):
        read_checkpoint(str(tmp_path))


def _truncate(file):
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


def _garbage(file):
    with open(file, "wb") as f:
        f.write(b"\x80\x04 not what was saved \xff\xfe")


def _megafab_common(damage):
    """The directory as megafab's earlier format (common.json beside the DCP files), damaged."""
    def apply(path):
        os.remove(os.path.join(path, "metadata.json"))
        with open(os.path.join(path, "common.json"), "wb") as f:
            f.write(damage)
    return apply


# (format, damage of iter_0000000, the message naming the file); every read path of every format
DAMAGED_FILES = [
    ("torch_dist", lambda p: _truncate(os.path.join(p, "common.pt")), r"common\.pt could not be read"),
    ("torch_dist", lambda p: _garbage(os.path.join(p, "common.pt")), r"common\.pt could not be read"),
    ("torch_dist", lambda p: os.remove(os.path.join(p, "common.pt")), r"common\.pt: missing, and the DCP"),
    ("torch_dist", lambda p: _garbage(os.path.join(p, "metadata.json")), r"metadata\.json: not valid JSON"),
    ("torch_dist", lambda p: _truncate(os.path.join(p, "metadata.json")), r"metadata\.json: not valid JSON"),
    ("torch_dist", lambda p: open(os.path.join(p, "metadata.json"), "w").write("[]"),
     r"metadata\.json: holds a JSON list, not an object"),
    ("torch_dist", lambda p: _garbage(os.path.join(p, ".metadata")), r"\.metadata is truncated or corrupt"),
    ("torch_dist", lambda p: _truncate(os.path.join(p, "__0_0.distcp")),
     r"__0_0\.distcp: \d+ bytes, but \.metadata places tensors up to byte \d+; the file is truncated"),
    ("torch_dist", _megafab_common(b"{not json"), r"common\.json: not valid JSON"),
    ("torch_dist", _megafab_common(b"\xff\xfe"), r"common\.json: not valid JSON"),
    ("torch_dist", _megafab_common(b'{"iteration": 3}'), r"common\.json: has no consumed_train_samples"),
    ("torch", lambda p: _truncate(os.path.join(p, "mp_rank_01", "model_optim_rng.pt")),
     r"mp_rank_01/model_optim_rng\.pt could not be read as a torch file"),
    ("torch", lambda p: _garbage(os.path.join(p, "mp_rank_00", "model_optim_rng.pt")),
     r"mp_rank_00/model_optim_rng\.pt could not be read as a torch file"),
]


@pytest.mark.parametrize("ckpt_format, damage, message", DAMAGED_FILES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(DAMAGED_FILES)])
def test_a_damaged_file_of_each_format_is_named(tmp_path, ckpt_format, damage, message):
    root, path, cfg = _written(tmp_path, ckpt_format, tp=2 if ckpt_format == "torch" else 1)
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        _open(root, cfg)


class _Payload:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_metadata_file_holding_code_is_refused_naming_the_file(tmp_path, capsys):
    """safe unpickling refuses the payload (rightly); the one message names the file, exit 2."""
    import pickle

    from megafab.cli.convert import main as convert

    root, path, _ = _written(tmp_path, "torch_dist")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Payload(), f)
    capsys.readouterr()  # writing the checkpoint's own phase lines
    assert convert(["convert", "--load-dir", root, "--save-dir", str(tmp_path / "out"), "--saver", "hf"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert os.path.join(path, ".metadata") in lines[0] and "refusing to unpickle" in lines[0], err


def test_a_model_of_another_depth_or_shape_is_refused_naming_the_checkpoint(tmp_path):
    from megafab.checkpoint import dcp_io
    from megafab.checkpoint.layout import Shard

    root, path, cfg = _written(tmp_path, "torch_dist")
    deeper = tiny_config(style=LLAMA_STYLE, num_layers=6)
    with pytest.raises(CheckpointError, match=f"^{path}: checkpoint tensor .* stacks 4 layers"):
        _open(root, deeper)
    source = _open(root, cfg)
    key = "model.decoder.final_layernorm.weight"
    with pytest.raises(CheckpointError, match=f"^{path}: checkpoint tensor '{key}' has global shape"):
        dcp_io.check_shards({key: Shard.whole(torch.zeros(5))}, source.stored, source.path)
    with pytest.raises(CheckpointError, match=f"^{path}: the checkpoint has no tensor 'model.x'"):
        dcp_io.check_shards({"model.x": Shard.whole(torch.zeros(5))}, source.stored, source.path)
