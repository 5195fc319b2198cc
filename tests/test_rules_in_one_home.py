"""Rules in one home (issue 36): the grad scaler's settings, every tokenizer type's files and a
conversion's target layout are refused before any expensive work, as one `megafab: error:` message
naming the flag and the file or value, exit 2, no traceback. pretrain_gpt.py's cases are ranks
forked from the test process (tests/helpers/main_ranks.py: imports paid once); megafab-convert and
one pretrain case run as plain subprocesses."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys

import pytest

from megafab import checks
from megafab.arguments import config_from_args
from megafab.config import ConfigError
from megafab.convert import ConversionError, write_checkpoint
from megafab.convert.checkpoint import target_config
from megafab.data.tokenizers import TOKENIZER_FILES, TOKENIZER_TYPES, build_tokenizer, file_problem
from megafab.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler, scaler_problems
from tests.helpers.main_ranks import run_ranks_main
from tests.helpers.tiny_corpus import TINY, assert_one_message

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "data", "fixtures")
GPT2 = {"--vocab-file": f"{FIXTURES}/gpt2_tiny/vocab.json",
        "--merge-file": f"{FIXTURES}/gpt2_tiny/merges.txt"}
SP_MODEL, HF_DIR = f"{FIXTURES}/sp_tiny.model", f"{FIXTURES}/hf_tiny"
HF_JSON = f"{HF_DIR}/tokenizer.json"
DRY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--micro-batch-size", "1", "--dry-run"]
TIKTOKEN = ["--tiktoken-pattern", "v2", "--vocab-size", "300", "--tiktoken-num-special-tokens", "16"]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="pretrain's cases fork their ranks")


def _model_built_marker(rank):
    """In the forked rank: building the model prints a marker (the errors must come before it)."""
    import megafab.training.build as build
    import megafab.training.pretrain as pretrain

    real = build.build_model

    def marked(*args, **kwargs):
        print("MODEL BUILT", file=sys.stderr, flush=True)
        return real(*args, **kwargs)

    build.build_model = pretrain.build_model = marked


def _refused(tmp_path, argv, pattern):
    result = run_ranks_main(1, argv, tmp_path, timeout=90, before_main=_model_built_marker)
    line = assert_one_message(result, pattern)
    assert "MODEL BUILT" not in result.err[0] and "megafab plan" not in result.out[0], result.describe()
    return line


# ---- the grad scaler -------------------------------------------------------------------------------

BAD_SCALER = {
    "hysteresis 0": (["--hysteresis", "0"], r"--hysteresis 0 must be >= 1"),
    "min scale 0": (["--min-loss-scale", "0"], r"--min-loss-scale 0\.0 must be in \(0, --initial-loss-scale"),
    "min above initial": (["--initial-loss-scale", "8", "--min-loss-scale", "16"],
                          r"--min-loss-scale 16\.0 must be in \(0, --initial-loss-scale 8\.0\]"),
    "window 0": (["--loss-scale-window", "0"], r"--loss-scale-window 0 must be >= 1"),
    "initial negative": (["--initial-loss-scale", "-1"], r"--initial-loss-scale -1\.0 must be positive"),
    "constant negative": (["--loss-scale", "-2"], r"--loss-scale is -2\.0; it must be positive"),
}


def test_scaler_problems_are_the_rules_the_scaler_asserts():
    assert scaler_problems() == [] and scaler_problems(loss_scale=128.0) == []
    assert scaler_problems(loss_scale=128.0, hysteresis=0) == []  # a constant scale uses no dynamic setting
    found = scaler_problems(hysteresis=0, growth_interval=0, min_scale=0.0)
    assert [p.split()[0] for p in found] == ["--min-loss-scale", "--loss-scale-window", "--hysteresis"]
    with pytest.raises(ValueError, match="--hysteresis 0 must be >= 1"):
        DynamicGradScaler(hysteresis=0)
    with pytest.raises(ValueError, match="--loss-scale is 0"):
        ConstantGradScaler(0)
    cfg = config_from_args(DRY + ["--vocab-size", "127", "--bf16", "--hysteresis", "0"], world_size=1)
    assert checks.problems(cfg) == []  # no fp16: no scaler is built, its settings are not asked


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("case", sorted(BAD_SCALER))
def test_bad_scaler_settings_stop_before_the_model(tmp_path, case, dry_run):
    flags, pattern = BAD_SCALER[case]
    run = ["--dry-run"] if dry_run else ["--mock-data", "--train-iters", "2"]
    _refused(tmp_path, TINY + ["--fp16", *flags, *run], pattern)


def test_pretrain_gpt_script_fp16_hysteresis_0(tmp_path):
    """The repo's pretrain_gpt.py in a process of its own: one line, exit 2, no traceback."""
    argv = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--fp16", "--hysteresis", "0",
            "--dry-run"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("megafab: error:")]
    assert len(errors) == 1 and "--hysteresis 0 must be >= 1" in done.stderr, done.stderr


# ---- tokenizer files -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizer_files")
    (root / "empty").write_bytes(b"")
    (root / "emptydir").mkdir()
    (root / "junkdir").mkdir()
    (root / "junkdir" / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    tokens = [bytes([i]) for i in range(256)] + [b"a" + bytes([c]) for c in range(97, 97 + 28)]
    (root / "tiktoken.json").write_text(json.dumps([
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
        for i, t in enumerate(tokens)]))  # 284 ranks + 16 special ids = --vocab-size 300
    return {"missing": str(root / "nowhere.model"), "empty": str(root / "empty"),
            "directory": str(root / "emptydir"), "junkdir": str(root / "junkdir"),
            "tiktoken": str(root / "tiktoken.json")}


WHAT_IS_WRONG = {"missing": "no such file or directory", "empty": r"is empty \(0 bytes\)",
                 "directory": "is a directory, not a file"}
SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def _tokenizer_cases():
    """(id, tokenizer flags with placeholders for the `files` fixture, flag at fault, wrong-file pattern)"""
    cases = []
    for flag, other in (("--vocab-file", "--merge-file"), ("--merge-file", "--vocab-file")):
        for bad in WHAT_IS_WRONG:
            cases.append((f"GPT2BPE {flag} {bad}", ["--tokenizer-type", "GPT2BPETokenizer", flag, bad,
                                                    other, GPT2[other]], flag, WHAT_IS_WRONG[bad]))
    cases.append(("GPT2BPE merges as vocab", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                              GPT2["--merge-file"], "--merge-file", GPT2["--merge-file"]],
                  "--vocab-file", "not a JSON vocabulary"))
    cases.append(("GPT2BPE vocab as merges", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                              GPT2["--vocab-file"], "--merge-file", GPT2["--vocab-file"]],
                  "--merge-file", "line 1 .* is not one merge 'a b'"))
    for kind in SENTENCEPIECE:
        for bad in WHAT_IS_WRONG:
            cases.append((f"{kind} {bad}", ["--tokenizer-type", kind, "--tokenizer-model", bad],
                          "--tokenizer-model", WHAT_IS_WRONG[bad]))
        for wrong in (HF_JSON, GPT2["--merge-file"]):  # a tokenizer.json, a text file
            cases.append((f"{kind} {os.path.basename(wrong)}", ["--tokenizer-type", kind, "--tokenizer-model",
                                                                wrong], "--tokenizer-model",
                          "not a SentencePiece model"))
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    for bad in ("missing", "empty"):
        cases.append((f"HuggingFace {bad}", hf + [bad], "--tokenizer-model", WHAT_IS_WRONG[bad]))
    cases += [("HuggingFace empty directory", hf + ["directory"], "--tokenizer-model",
               "the directory holds no tokenizer"),
              ("HuggingFace directory of junk", hf + ["junkdir"], "--tokenizer-model",
               "transformers cannot load a tokenizer from it"),
              ("HuggingFace sentencepiece file", hf + [SP_MODEL], "--tokenizer-model",
               "not a tokenizer.json")]
    tik = ["--tokenizer-type", "TikTokenizer", *TIKTOKEN, "--tokenizer-model"]
    for bad in WHAT_IS_WRONG:
        cases.append((f"TikTokenizer {bad}", tik + [bad], "--tokenizer-model", WHAT_IS_WRONG[bad]))
    cases.append(("TikTokenizer sentencepiece file", tik + [SP_MODEL], "--tokenizer-model",
                  "not a Megatron tiktoken vocabulary"))
    return cases


CASES = _tokenizer_cases()


def test_every_tokenizer_type_with_files_has_cases():
    covered = {c[1][c[1].index("--tokenizer-type") + 1] for c in CASES}
    assert covered == {t for t in TOKENIZER_TYPES if TOKENIZER_FILES[t]}
    assert TOKENIZER_FILES["NullTokenizer"] == ()


@pytest.mark.parametrize("flags,flag,wrong", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_tokenizer_file_is_one_message(tmp_path, files, flags, flag, wrong):
    flags = [files.get(f, f) for f in flags]
    path = flags[flags.index(flag) + 1]
    kind = flags[flags.index("--tokenizer-type") + 1]
    line = _refused(tmp_path, DRY + flags, rf"{flag} {re.escape(path)}: {wrong}")
    assert f"--tokenizer-type {kind} reads " in line  # the fix: what this type reads


GOOD = {"GPT2BPETokenizer": ["--vocab-file", GPT2["--vocab-file"], "--merge-file", GPT2["--merge-file"]],
        **{kind: ["--tokenizer-model", SP_MODEL] for kind in SENTENCEPIECE},
        "HuggingFaceTokenizer": ["--tokenizer-model", HF_DIR],
        "TikTokenizer": TIKTOKEN + ["--tokenizer-model", "tiktoken"]}


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_good_tokenizer_files_pass_the_probe_built_once(files, kind, monkeypatch):
    """The probe builds the tokenizer from good files; the vocabulary is sized from that very build
    and the data pipeline gets the same tokenizer."""
    import megafab.checks.probes as probes

    built = []
    monkeypatch.setattr(probes, "build_tokenizer", lambda *a: built.append(build_tokenizer(*a)) or built[-1])
    monkeypatch.setattr(probes, "_BUILT", {})
    flags = [files.get(f, f) for f in GOOD[kind]]
    cfg = config_from_args(DRY + ["--tokenizer-type", kind, *flags], world_size=1, start_up=True)
    assert len(built) == 1 and cfg.model.vocab_size == built[0].vocab_size > 0
    assert probes.tokenizer_of(cfg.data, cfg.model.vocab_size) is built[0]


def test_unreadable_file_is_named(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"x")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")) if str(p) == str(path) else real_open(p, *a, **k))
    assert file_problem("Llama2Tokenizer", "--tokenizer-model", str(path)) == (
        f"--tokenizer-model {path}: cannot be read (Permission denied); --tokenizer-type Llama2Tokenizer "
        f"reads a SentencePiece model file (tokenizer.model, as sentencepiece's trainer writes it)")


def test_all_file_problems_in_one_config_error(tmp_path, files):
    argv = DRY + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["empty"], "--merge-file",
                  files["missing"], "--fp16", "--hysteresis", "0"]
    with pytest.raises(ConfigError) as info:
        config_from_args(argv, world_size=1, start_up=True)
    assert [p.split()[0] for p in info.value.problems] == ["--hysteresis", "--vocab-file", "--merge-file"]


# ---- conversion to a layout that cannot hold the model --------------------------------------------

def _hf_dir(root, arch: str) -> str:
    """config.json of a tiny HF model and weights that cannot be read: a converter that reads a tensor
    before checking the layout ends with the weights' message, not the layout's."""
    from transformers import GPT2Config, MixtralConfig

    path = os.path.join(root, arch)
    if arch == "gpt2":  # 4 heads, 2 layers, FFN 48
        GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                   n_inner=48).save_pretrained(path)
    else:  # 4 experts
        MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      num_local_experts=4, num_experts_per_tok=2).save_pretrained(path)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"not safetensors")
    return path


IMPOSSIBLE = [
    ("gpt2", ["--target-tensor-parallel-size", "3"],
     [r"--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"]),
    ("gpt2", ["--target-pipeline-parallel-size", "3"],
     [r"--num-layers 2 is not divisible by pipeline stages"]),
    ("gpt2", ["--target-tensor-parallel-size", "0", "--saver", "torch"],
     [r"--tensor-model-parallel-size is 0; it must be at least 1"]),
    ("gpt2", ["--target-expert-parallel-size", "2"], [r"--expert-model-parallel-size 2 needs --num-experts"]),
    ("mixtral", ["--target-expert-parallel-size", "3", "--target-pipeline-parallel-size", "4"],
     [r"--num-experts 4 is not divisible by --expert-model-parallel-size 3",
      r"--num-layers 2 is not divisible"]),
]


@pytest.mark.parametrize("arch,flags,patterns", IMPOSSIBLE, ids=[" ".join(c[1]) for c in IMPOSSIBLE])
def test_conversion_to_an_impossible_layout_stops_before_reading_a_tensor(tmp_path, capsys, arch, flags,
                                                                           patterns):
    from megafab.cli.convert import main

    out = tmp_path / "out"
    assert main(["convert", "--hf-dir", _hf_dir(tmp_path, arch), "--save-dir", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("megafab: error:") == 1 and "cannot hold this model" in err, err
    for pattern in patterns:
        assert re.search(pattern, err), (pattern, err)
    assert not out.exists()  # nothing written


def test_megafab_convert_process_impossible_layout(tmp_path):
    """tools/convert_checkpoint.py in a process of its own: one message, exit 2, no traceback."""
    arch, flags, patterns = IMPOSSIBLE[-1]
    argv = [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "convert", "--hf-dir",
            _hf_dir(tmp_path, arch), "--save-dir", str(tmp_path / "out"), *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("megafab: error:")]
    assert len(errors) == 1 and all(re.search(p, done.stderr) for p in patterns), done.stderr


def test_write_checkpoint_checks_the_layout_before_writing(tmp_path):
    cfg = config_from_args(DRY + ["--vocab-size", "100", "--ffn-hidden-size", "50"], world_size=1)
    with pytest.raises(ConversionError, match=r"--ffn-hidden-size 50 is not divisible by "
                                              r"--tensor-model-parallel-size 4") as info:
        write_checkpoint(str(tmp_path / "ck"), {}, cfg, tp=4, pp=3)
    assert "--num-layers 2 is not divisible by pipeline stages x virtual stages = 3 x 1" in str(info.value)
    assert not (tmp_path / "ck").exists()
    target = target_config(cfg, tp=2, pp=2)
    assert (target.parallel.tensor_model_parallel_size, target.parallel.pipeline_model_parallel_size,
            target.parallel.expert_tensor_parallel_size, target.model.padded_vocab_size) == (2, 2, 2, 256)
