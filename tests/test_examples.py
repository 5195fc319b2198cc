"""examples/*.sh and slurm/*.sbatch: valid bash, and the pretrain_gpt.py flags they launch pass
megafab's flag validation at the world size they launch.

The launchers (torchrun, srun, sbatch, scontrol) are replaced by shims on PATH that record their
argv, so the real scripts run end to end without GPUs or a SLURM cluster.
"""

import os
import subprocess

import numpy as np
import pytest

from megafab.arguments import config_from_args
from megafab.data.indexed_dataset import IndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["examples/quickstart.sh", "examples/gpt3_125m.sh", "examples/gpt3_1.3b.sh", "examples/llama_7b.sh",
           "slurm/train_gpt.sbatch", "slurm/train_gpt_srun.sbatch", "slurm/preprocess_array.sbatch"]

RECORD = 'printf "%s\\0" "$(basename "$0")" "$@" > "$SHIM_LOG/$(date +%s%N)"\n'
SHIMS = {
    "torchrun": RECORD,
    "srun": RECORD,
    "scontrol": RECORD + '[ "$1 $2" = "show hostnames" ] && printf "gpu-a17\\ngpu-a18\\n"\n',
    # sbatch --parsable prints the job id; a different one per call.
    "sbatch": RECORD + 'echo $(( 4242 + $(ls "$SHIM_LOG" | wc -l) ))\n',
}


@pytest.fixture
def shim_env(tmp_path):
    """PATH with recording launchers, and placeholder data/tokenizer files the flags point at."""
    bin_dir, log_dir, data = tmp_path / "bin", tmp_path / "calls", tmp_path / "data"
    for d in (bin_dir, log_dir, data):
        d.mkdir()
    for name, body in SHIMS.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    for name in ("corpus_text_document.bin", "corpus_text_document.idx", "vocab.json", "merges.txt",
                 "tokenizer.model"):
        (data / name).write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SHIM_LOG=str(log_dir),
               DATA_PATH=str(data / "corpus_text_document"), VOCAB_FILE=str(data / "vocab.json"),
               MERGE_FILE=str(data / "merges.txt"), TOKENIZER_MODEL=str(data / "tokenizer.model"),
               CHECKPOINT_PATH=str(tmp_path / "ckpt"), TENSORBOARD_DIR=str(tmp_path / "tb"))
    return env


def run_script(script, env, *args):
    result = subprocess.run(["bash", os.path.join(ROOT, script), *args], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def calls(env):
    """Every recorded launcher call, in order, as [name, arg1, ...]."""
    log_dir = env["SHIM_LOG"]
    return [open(os.path.join(log_dir, f)).read().split("\0")[:-1] for f in sorted(os.listdir(log_dir))]


def option(argv, name):
    """The value of `name VALUE` or `name=VALUE` in argv."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    raise AssertionError(f"{name} not in {argv}")


def pretrain_flags(argv):
    return argv[argv.index("pretrain_gpt.py") + 1:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    result = subprocess.run(["bash", "-n", os.path.join(ROOT, script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script, tp, pp, dp", [("examples/gpt3_125m.sh", 1, 1, 8),
                                                ("examples/gpt3_1.3b.sh", 2, 1, 4),
                                                ("examples/llama_7b.sh", 2, 2, 2)])
def test_gpu_example_launches_valid_flags(shim_env, script, tp, pp, dp):
    run_script(script, shim_env, "--exit-interval", "7")
    (launch,) = calls(shim_env)
    assert launch[0] == "torchrun" and option(launch, "--nproc-per-node") == "8"
    flags = pretrain_flags(launch)
    assert flags[-2:] == ["--exit-interval", "7"]  # extra arguments reach pretrain_gpt.py
    cfg = config_from_args(flags, world_size=8)
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
            cfg.parallel.data_parallel_size) == (tp, pp, dp)
    assert cfg.parallel.use_distributed_optimizer and cfg.precision.bf16
    assert cfg.checkpoint.save == shim_env["CHECKPOINT_PATH"] == cfg.checkpoint.load


def test_quickstart_training_flags_are_valid_on_8_processes(shim_env, tmp_path):
    data = tmp_path / "qs" / "data"
    data.mkdir(parents=True)
    for name in ("english_train_text_document.bin", "english_train_text_document.idx",
                 "english_valid_text_document.bin", "english_valid_text_document.idx", "english.model"):
        (data / name).write_text("")
    # TRAIN_FLAGS is one bash array in the script: evaluate it alone with the script's variables set.
    snippet = ('eval "$(sed -n "/^TRAIN_FLAGS=(/,/^)/p" examples/quickstart.sh)"; '
               'printf "%s\\0" "${TRAIN_FLAGS[@]}"')
    env = dict(shim_env, OUT=str(tmp_path / "qs"), DATA=str(data), CKPT=str(tmp_path / "qs" / "ck"),
               ITERS="300")
    out = subprocess.run(["bash", "-c", "set -u; " + snippet], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    cfg = config_from_args(out.split("\0")[:-1], world_size=8)
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (2, 2, 2)
    assert p.sequence_parallel and p.use_distributed_optimizer and p.distributed_backend == "gloo"
    assert cfg.data.valid_data_path == [str(data / "english_valid_text_document")]
    assert cfg.training.train_iters == 300 and cfg.checkpoint.save == str(tmp_path / "qs" / "ck")


def test_train_gpt_sbatch_runs_one_torchrun_per_node(shim_env):
    env = dict(shim_env, SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8",
               SLURM_JOB_ID="991", SLURM_SUBMIT_DIR=ROOT)
    run_script("slurm/train_gpt.sbatch", env)
    scontrol, srun = calls(env)
    assert scontrol[1:] == ["show", "hostnames", "gpu-a[17-18]"]
    assert srun[0] == "srun" and option(srun, "--ntasks-per-node") == "1"
    torchrun = srun[srun.index("torchrun"):]
    assert option(torchrun, "--rdzv-endpoint") == "gpu-a17:29500"
    assert option(torchrun, "--nnodes") == "2" and option(torchrun, "--nproc-per-node") == "8"
    cfg = config_from_args(pretrain_flags(torchrun), world_size=16)
    assert cfg.parallel.data_parallel_size == 8 and cfg.training.exit_duration_in_mins == 1420


def test_train_gpt_srun_sbatch_runs_one_task_per_gpu(shim_env):
    env = dict(shim_env, SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_NTASKS="16", SLURM_SUBMIT_DIR=ROOT)
    run_script("slurm/train_gpt_srun.sbatch", env)
    (srun,) = calls(env)
    assert srun[0] == "srun" and "torchrun" not in srun
    cfg = config_from_args(pretrain_flags(srun), world_size=16)
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (2, 2, 4)
    assert cfg.training.exit_signal_handler


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.endswith(".sbatch")])
def test_sbatch_headers_carry_placeholders_to_fill(script):
    header = [line for line in open(os.path.join(ROOT, script)) if line.startswith("#SBATCH")]
    assert any(line.startswith("#SBATCH --partition=<") for line in header)
    assert any(line.startswith("#SBATCH --account=<") for line in header)
    assert any(line.startswith("#SBATCH --time=") for line in header)


def test_preprocess_array_submits_shards_then_merges_them_in_order(shim_env, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    docs = {"b.jsonl": ["4 5 6", "7"], "a.jsonl": ["1 2 3", "8 9", "10 11 12 13"]}
    for name, texts in docs.items():
        (raw / name).write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    env = dict(shim_env, INPUT_GLOB=f"{raw}/*.jsonl", OUTPUT_PREFIX=str(tmp_path / "out" / "corpus"),
               TOKENIZER_ARGS="--tokenizer-type NullTokenizer --vocab-size 100", WORKERS="1",
               SLURM_SUBMIT_DIR=ROOT)
    out = run_script("slurm/preprocess_array.sbatch", env)
    array, merge = calls(env)
    assert option(array, "--array") == "0-1%64" and "--export=ALL,PREPROCESS_STEP=shard" in array
    array_id = out.split("job array ")[1].split(",")[0]
    assert option(merge, "--dependency") == f"afterok:{array_id}"
    assert "--export=ALL,PREPROCESS_STEP=merge" in merge

    # What SLURM would then run: the array tasks (concurrently) and the merge job.
    tasks = [subprocess.Popen(["bash", os.path.join(ROOT, "slurm/preprocess_array.sbatch")], cwd=ROOT,
                              env=dict(env, PREPROCESS_STEP="shard", SLURM_ARRAY_TASK_ID=str(task)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for task in range(2)]
    for task in tasks:
        _, err = task.communicate(timeout=120)
        assert task.returncode == 0, err
    run_script("slurm/preprocess_array.sbatch", dict(env, PREPROCESS_STEP="merge"))
    merged = IndexedDataset(str(tmp_path / "out" / "corpus_text_document"))
    got = [merged[i].tolist() for i in range(len(merged))]
    eod = 100
    expected = [[int(x) for x in t.split()] + [eod] for name in sorted(docs) for t in docs[name]]
    assert got == expected
    assert isinstance(merged[0], np.ndarray)


def test_preprocess_array_refuses_an_empty_glob(shim_env, tmp_path):
    env = dict(shim_env, INPUT_GLOB=f"{tmp_path}/nothing/*.jsonl", OUTPUT_PREFIX=str(tmp_path / "o"))
    result = subprocess.run(["bash", os.path.join(ROOT, "slurm/preprocess_array.sbatch")], env=env, cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 1 and "matches no file" in result.stderr
    assert calls(env) == []
