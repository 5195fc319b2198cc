"""megafab-convert with its output in a log file: each phase is one plain line, never a bar (no
carriage returns, no bar glyphs); on a terminal the same phases are bars."""

import os
import subprocess
import sys

import torch

from megafab.convert import write_checkpoint
from megafab.model.gpt import GPTModel
from tests.helpers.tiny import LLAMA_STYLE, context, tiny_config

BAR_MARKS = ("\r", "|#", "█", "it/s", "step/s", "s/step")


def test_convert_into_a_log_file_writes_no_bar(tmp_path):
    cfg = tiny_config(style=LLAMA_STYLE)
    model = GPTModel(cfg.model, context(dtype=torch.float32))
    write_checkpoint(str(tmp_path / "dist"), {k: v.detach() for k, v in model.state_dict().items()}, cfg)
    log = tmp_path / "convert.log"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "megafab", "convert", "convert",
                             "--load-dir", str(tmp_path / "dist"), "--save-dir", str(tmp_path / "torch"),
                             "--saver", "torch", "--target-tensor-parallel-size", "2"],
                            stdout=out, stderr=subprocess.STDOUT, env=env, timeout=120).returncode
    text = log.read_text()
    assert rc == 0, text
    assert not [mark for mark in BAR_MARKS if mark in text], repr(text)
    lines = text.splitlines()
    assert "reading torch_dist (5 step)" in lines and "writing torch (2 step)" in lines, lines
    assert lines[-1].startswith("converted "), lines


def _damaged_hf_dir(tmp_path, damage):
    from tests.helpers.hf_tiny import hf_llama

    hf_llama(groups=2).save_pretrained(tmp_path / "hf")
    damage(tmp_path / "hf")
    return str(tmp_path / "hf")


def _cut(file):
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])


def test_a_damaged_hf_file_is_one_message_naming_it(tmp_path, capsys):
    from megafab.cli.convert import main as convert

    for name, damage in (("config.json", lambda d: (d / "config.json").write_text("{not json")),
                         ("model.safetensors", lambda d: _cut(d / "model.safetensors"))):
        hf = _damaged_hf_dir(tmp_path / name, damage)
        capsys.readouterr()  # transformers' own bar while saving the model
        assert convert(["convert", "--hf-dir", hf, "--save-dir", str(tmp_path / "out")]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and f"{hf}/{name} could not be read" in lines[0], lines
