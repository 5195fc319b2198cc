"""Rules that used to be found only at run time (after process groups, datasets and the model were
built) are now checked before start: `pretrain_gpt.py ... --dry-run` refuses each with exit 2 and
one message, and several at once in that one message."""

import os
import subprocess
import sys

import pytest

from tests.helpers.flags import tiny_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = tiny_flags(num_layers=2) + [
    "--micro-batch-size", "1", "--vocab-size", "100", "--lr", "1e-4", "--train-iters", "10", "--dry-run"]

# (what, flags, a line of the message), each a rule whose only check used to be at run time:
CATALOGUE = [
    ("min-lr above lr (LR scheduler)", ["--min-lr", "1e-3"], "--min-lr 0.001 must be in [0, --lr 0.0001]"),
    ("WSD without decay samples (LR scheduler)", ["--lr-decay-style", "WSD"],
     "--lr-decay-style WSD needs --lr-wsd-decay-samples (or --lr-wsd-decay-iters)"),
    ("non-positive bucket size (DDP)", ["--ddp-bucket-size", "0"],
     "--ddp-bucket-size is 0; it must be a positive"),
    ("post-norm residual under TE (TE's layer rules)",
     ["--transformer-impl", "transformer_engine", "--apply-residual-connection-post-layernorm"],
     "--apply-residual-connection-post-layernorm implemented for --transformer-impl local only"),
    ("recompute without its layer count (recompute)",
     ["--recompute-granularity", "full", "--recompute-method", "uniform"],
     "--recompute-granularity full needs --recompute-num-layers"),
    ("offload fraction out of range (optimizer offload)",
     ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"],
     "--optimizer-offload-fraction 1.5 must be in [0, 1]"),
    ("heads not divisible by TP (layout)", ["--tensor-model-parallel-size", "3"],
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    ("sequence not divisible by CP chunks (layout)", ["--seq-length", "18", "--context-parallel-size", "2"],
     "--seq-length 18 is not divisible by 2 x --context-parallel-size 2 = 4"),
]


def dry_run(flags, world_size=4):
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": str(world_size)}
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        env.pop(name, None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE, *flags],
                          capture_output=True, text=True, env=env, timeout=180)


def assert_one_message(proc, lines):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    assert out.count("problem(s) in the configuration") == 1, out
    for line in lines:
        assert out.count(line) == 1, (line, out)


def test_the_base_command_line_is_fine():
    proc = dry_run([])
    assert proc.returncode == 0, proc.stdout + proc.stderr


ALONE = [CATALOGUE[0], CATALOGUE[4]]  # one process each; the rest are checked together below


@pytest.mark.parametrize("what,flags,line", ALONE, ids=[c[0] for c in ALONE])
def test_each_run_time_rule_is_refused_by_a_dry_run(what, flags, line):
    assert_one_message(dry_run(flags), [line])


def test_every_run_time_rule_at_once_is_one_message():
    """All of them in one command line (the TE case also lists the machine check's problem, TE
    absent or no GPU here, in the same list: a recompute error no longer replaces the list).
    --recompute-granularity full is left out: it would override the TE case's selective."""
    together = [c for c in CATALOGUE if c is not CATALOGUE[4]]
    proc = dry_run([flag for _, flags, _ in together for flag in flags])
    assert_one_message(proc, [line for _, _, line in together])
    out = proc.stdout + proc.stderr
    assert "--transformer-impl transformer_engine needs" in out
    assert "world size 4 is not divisible by --tensor-model-parallel-size 3" in out
