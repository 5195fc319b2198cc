"""Megatron-LM HEAD's example launch scripts (d98e8a64dd, copied unchanged to tests/data/fixtures/
megatron_scripts/head_*.sh): examples/gpt3/train_gpt3_175b_distributed.sh,
examples/llama/train_llama3_8b_h100_fp8.sh, examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh
(its default Megatron-FSDP run, no nsys, USE_UV=0 for a plain `python`) and
examples/mixtral/train_mixtral_8x7b_distributed.sh, each run by bash with its own arguments (a tiny
dataset, GPT-2 and SentencePiece vocabularies, temporary directories; the mock-data branch where the
script has one), its torchrun caught (tests/helpers/megatron_scripts.py), and pretrain_gpt.py's
arguments as bash expands them through `pretrain_gpt.py --dry-run` at the world the script implies:
gpt3 TP 8 x PP 16 = 128 (16 of its 8-GPU nodes: "Change for multinode config"), Mixtral 4 nodes of 8
(SLURM_NNODES=4: EP 8 x PP 4), the Llama ones their one node of 8.

Nothing is unrecognized and nothing raises; gpt3 and Mixtral plan with nothing refused. The Llama
scripts' one message lists what this machine lacks (FP8 needs Transformer Engine on a GPU, "fused"
attention a CUDA GPU) and what megafab refuses on any machine (MEGAFAB_REFUSES, checked by the same
dry run without the machine checks).
"""

import os
import subprocess
import sys

import pytest
import torch

from megafab.data.indexed_dataset import IndexedDatasetWriter
from tests.helpers.functional_corpus import dry_run
from tests.helpers.megatron_scripts import launch_script_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "data", "fixtures")
SCRIPTS = os.path.join(FIXTURES, "megatron_scripts")
NODES_FOR_LAYOUT = {"gpt3": 16}  # the script's NUM_NODES=1 "Change for multinode config"
# what megafab refuses in these scripts on any machine (a GPU with Transformer Engine included)
MEGAFAB_REFUSES = {
    "gpt3": [], "mixtral": [],
    "llama3_fp8": [],
    "llama3_fsdp_fp8": []}
# what only this machine lacks: Transformer Engine / FP8 on a CUDA GPU, cuDNN's fused attention
MACHINE = ("--fp8-format needs", "--transformer-impl transformer_engine needs",
           "--attention-backend fused needs", "--fp8-param-gather needs Transformer Engine")
PLAN_LAYOUT = {"gpt3": "world 128 = TP 8 x PP 16 x DP 1", "mixtral": "world 32 = TP 1 x PP 4 x DP 8"}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """name -> (torch.distributed.run's arguments, pretrain_gpt.py's, the world)."""
    root = tmp_path_factory.mktemp("head_scripts")
    writer = IndexedDatasetWriter(str(root / "corpus_text_document.bin"))
    writer.add_document([1, 2, 3, 0])
    writer.finalize(str(root / "corpus_text_document.idx"))
    data, gpt2 = str(root / "corpus_text_document"), os.path.join(FIXTURES, "gpt2_tiny")
    runs = {
        "gpt3": ("head_train_gpt3_175b_distributed.sh", [str(root / "ckpt"), str(root / "tb"),
                 os.path.join(gpt2, "vocab.json"), os.path.join(gpt2, "merges.txt"), data], {}),
        "llama3_fp8": ("head_train_llama3_8b_h100_fp8.sh", [str(root / "ckpt2"), str(root / "tb2")], {}),
        "llama3_fsdp_fp8": ("head_train_llama3_8b_fsdp_h100_fp8.sh", [
            str(root / "ckpt3"), "MOCK", "MOCK", str(root / "nsys"), str(root / "tb3")], {"USE_UV": "0"}),
        "mixtral": ("head_train_mixtral_8x7b_distributed.sh", [
            str(root / "ckpt4"), os.path.join(FIXTURES, "sp_tiny.model"), data], {"SLURM_NNODES": "4"}),
    }
    out = {}
    for name, (script, args, env) in runs.items():
        work = root / f"work_{name}"
        work.mkdir()
        torchrun, argv = launch_script_flags(os.path.join(SCRIPTS, script), args, str(work), env)
        per_node, nodes = (int(torchrun[torchrun.index(f) + 1]) for f in ("--nproc_per_node", "--nnodes"))
        out[name] = (torchrun, argv, per_node * NODES_FOR_LAYOUT.get(name, nodes))
    return out


def test_the_scripts_launch_what_their_worlds_say(scripts):
    assert {name: world for name, (_, _, world) in scripts.items()} == \
        {"gpt3": 128, "llama3_fp8": 8, "llama3_fsdp_fp8": 8, "mixtral": 32}
    argv = scripts["gpt3"][1]  # the quoted schedule, split into words by the unquoted array expansion
    i = argv.index("--step-batch-size-schedule")
    assert argv[i + 1:i + 7] == ["0:16", "2.4B:320", "4.8B:624", "7.2B:928", "9.6B:1232", "12B:1536"]


@pytest.mark.parametrize("name", sorted(MEGAFAB_REFUSES))
def test_script_dry_run_as_written(name, scripts):
    _, argv, world = scripts[name]
    env = {**os.environ, "WORLD_SIZE": str(world), "PYTHONPATH": ROOT}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv, "--dry-run"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert "unrecognized" not in proc.stderr
    megafab = MEGAFAB_REFUSES[name]
    rules = dry_run(argv, world, with_machine=False)  # megafab's own rules: the same on a GPU with TE
    assert len(rules.problems) == len(megafab) and \
        all(sum(want in p for p in rules.problems) == 1 for want in megafab), rules.problems
    if name in PLAN_LAYOUT:
        assert proc.returncode == 0, proc.stderr
        assert f"megafab plan: {PLAN_LAYOUT[name]}" in proc.stdout
        return
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.count("megafab: error:") == 1  # one message for the whole command line
    problems = [line[4:] for line in proc.stderr.splitlines() if line.startswith("  - ")]
    machine = [p for p in problems if p not in rules.problems]
    assert sorted(problems) == sorted(machine + rules.problems)
    assert all(p.startswith(MACHINE) for p in machine), machine
    if not torch.cuda.is_available():  # FP8 and fused attention each refused here
        assert any(p.startswith("--fp8-format needs") for p in machine), machine
        assert any(p.startswith("--attention-backend fused needs") for p in machine), machine
