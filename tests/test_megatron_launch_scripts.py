"""Megatron-LM's own example launch scripts, their flags given to pretrain_gpt.py unchanged.

The flag sets below are the argument lists those scripts hand to pretrain_gpt.py, written out as
bash expands them (an array element "--fp8-format hybrid" becomes two words, "--split '99,1,0'"
keeps its quote characters), from NVIDIA/Megatron-LM:
  * examples/gpt3/train_gpt3_175b_distributed.sh at core_v0.16.1 (the release in the venv), and
    on main, where --step-batch-size-schedule replaced --rampup-batch-size;
  * examples/llama/train_llama3_8b_h100_fp8.sh (mock-data branch);
  * examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh on main (mock-data branch, the
    Megatron-FSDP block on, no NSYS_PROFILE);
  * examples/mixtral/train_mixtral_8x7b_distributed.sh at core_v0.16.1 (8 experts top-2, EP 8,
    PP 4, no WANDB_API_KEY), at world 32 (4 nodes of 8: the expert grid EP 8 x PP 4).
Only paths are substituted (a tiny dataset, GPT-2 vocabulary files, temporary directories). Each
set runs through `pretrain_gpt.py --dry-run` with the world size its script implies: no argparse
rejection, no crash, every flag honoured, refused by name (all in one message) or announced as
having no effect. A shrunk copy of the Llama-3 8B set trains 3 iterations on CPU.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from megafab.arguments import SPELLINGS, build_parser
from megafab.config import SECTIONS
from megafab.data.indexed_dataset import IndexedDatasetWriter
from megafab.megatron_flags import NO_EFFECT, REFUSED
from megafab.model.te import te_available
from tests.helpers.flags import tiny_flags
from tests.helpers.megatron_scripts import GPT3_175B_CORE_0_16_1, GPT3_175B_MAIN, MIXTRAL_8X7B, fill, words

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


LLAMA3_8B_MODEL = words("""
    --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
    --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
    --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134
    --attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights
    --disable-bias-linear""")
LLAMA3_8B_TRAINING = words("""
    --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
    --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16""")
LLAMA3_8B_FP8_DTYPE = words("--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max "
                            "--fp8-param-gather")
LLAMA3_8B_PARALLEL = words("--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel")
LLAMA3_8B_DDP = words("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")
LLAMA3_8B_MOCK_DATA = words("""
    --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path {cache}
    --tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files
    --num-workers 1""")
LLAMA3_8B_FP8 = LLAMA3_8B_MODEL + LLAMA3_8B_TRAINING + words("""
    --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
    --empty-unused-memory-level 1 --exit-duration-in-mins 235""") + LLAMA3_8B_DDP + LLAMA3_8B_FP8_DTYPE \
    + LLAMA3_8B_PARALLEL + LLAMA3_8B_MOCK_DATA + words("""
    --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
    --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
    --save {ckpt} --load {ckpt} --tensorboard-dir {tb}""")
LLAMA3_8B_FSDP = LLAMA3_8B_MODEL + LLAMA3_8B_TRAINING + words("""
    --cross-entropy-loss-fusion --no-check-for-nan-in-loss-and-grad --manual-gc --empty-unused-memory-level 1
    --exit-duration-in-mins 235
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion
    --calculate-per-token-loss --init-model-with-meta-device --ckpt-format fsdp_dtensor --use-nccl-ub
    --fsdp-double-buffer --fsdp-manual-registration""") + LLAMA3_8B_DDP + LLAMA3_8B_FP8_DTYPE \
    + LLAMA3_8B_PARALLEL + LLAMA3_8B_MOCK_DATA + words("""
    --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput
    --logging-level 20 --distributed-timeout-minutes 60 --save {ckpt} --load {ckpt} --tensorboard-dir {tb}""")

# FP8 needs Transformer Engine on a CUDA GPU; "fused" attention needs CUDA. Where they are missing
# the run is refused with that reason (and accepted where they exist).
ON_GPU = torch.cuda.is_available()
FP8_HERE = ["--fp8-format needs transformer_engine"] if not te_available() else \
    [] if ON_GPU else ["--fp8-format needs a CUDA GPU"]  # one message: TE's absence, else the device
FUSED_HERE = [] if ON_GPU else ["--attention-backend fused needs a CUDA GPU"]
# FP8 weights (--fp8-param-gather) need TE on an FP8 GPU
FP8_PARAMS_HERE = [] if ON_GPU and te_available() else ["--fp8-param-gather needs Transformer Engine"]
# --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params runs as torch FSDP2
# (ZeRO-3) around Transformer Engine's FP8 layers too: no FSDP2 limit in these scripts.
FSDP_LIMITS: list[str] = []

# (flags, world size the script implies, the problems the one message must list; none: the plan prints)
CASES = {
    # Megatron 0.16.1 itself rejects this script: "expected no batch-size rampup for iteration-based training"
    "gpt3-175b@core_v0.16.1": (GPT3_175B_CORE_0_16_1, 128,
                               ["--rampup-batch-size needs sample-based training"]),
    # (Megatron-LM HEAD's parser rejects the schedule split into words, and validate_args --global-batch-size
    # with it; megafab takes both: the words as one schedule, the batch size as the schedule's last)
    "gpt3-175b@main": (GPT3_175B_MAIN, 128, []),
    "gpt3-175b@core_v0.16.1-sample-based": (
        [{"--train-iters": "--train-samples", "500000": "768000000",
          "--lr-decay-iters": "--lr-decay-samples", "430000": "660480000"}.get(a, a)
         for a in GPT3_175B_CORE_0_16_1], 128, []),
    "llama3-8b-fp8": (LLAMA3_8B_FP8, 8, FP8_HERE + FP8_PARAMS_HERE + FUSED_HERE),
    "llama3-8b-fsdp-fp8": (LLAMA3_8B_FSDP, 8, FSDP_LIMITS + FP8_HERE + FP8_PARAMS_HERE + FUSED_HERE),
    "mixtral-8x7b@core_v0.16.1": (MIXTRAL_8X7B, 32, []),
}
# The plan's layout line of the cases that pass.
PLAN_LAYOUT = {"gpt3-175b@core_v0.16.1-sample-based": "TP 8 x PP 16 x DP 1",
               "gpt3-175b@main": "TP 8 x PP 16 x DP 1",
               "mixtral-8x7b@core_v0.16.1": "TP 1 x PP 4 x DP 8"}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_scripts")
    writer = IndexedDatasetWriter(str(root / "corpus_text_document.bin"))
    writer.add_document([1, 2, 3, 0])
    writer.finalize(str(root / "corpus_text_document.idx"))
    (root / "gpt2-vocab.json").write_text(json.dumps({"<|endoftext|>": 0, "t": 1, "h": 2, "th": 3}))
    (root / "gpt2-merges.txt").write_text("#version: 0.2\nt h\n")
    return {"data": str(root / "corpus_text_document"), "vocab": str(root / "gpt2-vocab.json"),
            "merges": str(root / "gpt2-merges.txt"), "ckpt": str(root / "ckpt"), "tb": str(root / "tb"),
            "cache": str(root / "cache"),
            "spm": os.path.join(ROOT, "tests", "data", "fixtures", "sp_tiny.model")}


def dry_run(flags, world):
    env = {**os.environ, "WORLD_SIZE": str(world), "PYTHONPATH": ROOT}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--dry-run"],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_example_flags_dry_run(case, paths):
    flags, world, expected = CASES[case]
    proc = dry_run(fill(flags, paths), world)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert "unrecognized" not in proc.stderr
    if not expected:
        assert proc.returncode == 0, proc.stderr
        assert f"megafab plan: world {world} = {PLAN_LAYOUT[case]}" in proc.stdout
        return
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("megafab: error:") == 1  # one message for the whole command line
    problems = [line[4:] for line in proc.stderr.splitlines() if line.startswith("  - ")]
    for want in expected:
        assert sum(want in p for p in problems) == 1, (want, problems)
    assert len(problems) == len(expected), problems


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_flag_is_honoured_refused_or_announced(case, paths):
    """No flag of the script is silently ignored: it maps onto a config field (which megafab code
    reads, see test_every_config_field_is_read_by_megafab), is refused by name, or is in the
    "accepted, no effect" table that is printed at start-up."""
    parser = build_parser()
    fields = {f for section in SECTIONS.values() for f in section.__dataclass_fields__}
    spellings = {flag for entries in SPELLINGS.values() for flag, _, _ in entries}  # mapped onto fields
    for token in fill(CASES[case][0], paths):
        if not token.startswith("--"):
            continue
        if token in REFUSED or token in NO_EFFECT or token in spellings:
            continue
        action = parser._option_string_actions.get(token)
        assert action is not None, f"{token} is unknown to megafab"
        assert action.dest in fields, f"{token} parses into {action.dest!r}, which no config field holds"


# Parsed, but what they control is still being built (the owning issue deletes its line here).
NOT_YET_READ: dict[str, str] = {}


def attribute_reads(source: str) -> set[str]:
    """The attribute names `source` reads: `x.name` loaded (not assigned or deleted) and
    getattr(x, "name"[, default]) with a constant name."""
    reads = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            reads.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            reads.add(node.args[1].value)
    return reads


def unread_fields(fields, sources) -> list[str]:
    reads = set().union(*(attribute_reads(s) for s in sources))
    return [f for f in fields if f not in reads]


def _megafab_sources() -> list[str]:
    """megafab's code and pretrain_gpt.py; not arguments.py (declaring a flag is not reading it)."""
    paths = [p for p in sorted(pathlib.Path(ROOT, "megafab").rglob("*.py")) if p.name != "arguments.py"]
    return [p.read_text(encoding="utf-8") for p in paths + [pathlib.Path(ROOT, "pretrain_gpt.py")]]


def _config_fields() -> list[str]:
    return [f for section in SECTIONS.values() for f in section.__dataclass_fields__ if f not in NOT_YET_READ]


def test_every_config_field_is_read_by_megafab():
    """A field nobody reads is a flag megafab would accept and ignore. Reads in config/ count
    (derivations and validation); the argparse declarations in arguments.py do not. A read is an
    attribute access or a getattr with the field's name, not the name in a string or a comment."""
    sources = _megafab_sources()
    assert unread_fields(_config_fields(), sources) == [], "config fields no megafab code reads"
    read_now = [f for f in NOT_YET_READ if f not in unread_fields(NOT_YET_READ, sources)]
    assert read_now == [], "read now: delete their NOT_YET_READ lines"


def test_the_field_read_scan_catches_an_unread_field():
    source = """
cfg.model.read_as_attribute + getattr(cfg, "read_by_getattr", None)
cfg.only_assigned = 1
del cfg.only_deleted
getattr(cfg, name_in_a_variable)
print("only_in_a_string", cfg.get("only_as_a_key"))  # only_in_a_comment
def only_a_parameter(only_an_argument=1): return only_an_argument
"""
    fields = ["read_as_attribute", "read_by_getattr", "only_assigned", "only_deleted", "only_in_a_string",
              "only_as_a_key", "only_in_a_comment", "only_a_parameter", "only_an_argument"]
    assert unread_fields(fields, [source]) == fields[2:]
    # and over megafab itself: a field added to a section that nothing reads is reported
    assert unread_fields(_config_fields() + ["an_added_field_nothing_reads"], _megafab_sources()) == \
        ["an_added_field_nothing_reads"]


def test_shrunk_llama3_8b_trains_three_iterations_on_cpu(paths, tmp_path):
    """The Llama-3 8B FP8 script's flags, shrunk: model and batch sizes, run length and the
    profiling window are made tiny. What needs a GPU is refused here by name (the dry-run test), so
    for this CPU run the FP8 flags are left out and --attention-backend fused becomes flash. Two
    DP ranks."""
    from tests.helpers.launch import pretrain_in_ranks

    shrink = dict(zip(*[iter(words("""
        --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2
        --kv-channels 16 --seq-length 32 --max-position-embeddings 32 --global-batch-size 4
        --train-samples 12 --lr-decay-samples 12 --lr-warmup-samples 4 --vocab-size 256 --eval-iters 1
        --profile-step-start 1 --profile-step-end 2 --num-workers 0 --attention-backend flash"""))] * 2))
    source = fill(LLAMA3_8B_FP8, {**paths, "ckpt": str(tmp_path / "ckpt"), "tb": str(tmp_path / "tb")})
    fp8 = source.index(LLAMA3_8B_FP8_DTYPE[0])
    source = source[:fp8] + source[fp8 + len(LLAMA3_8B_FP8_DTYPE):]
    flags = [shrink.get(source[i - 1], t) if i and source[i - 1] in shrink else t
             for i, t in enumerate(source)]
    outputs = pretrain_in_ranks(flags, world_size=2, timeout=600)
    text = "".join(outputs)
    iterations = [line for line in text.splitlines() if " iteration " in line and "lm loss:" in line]
    assert len(iterations) == 3, text
    assert "global batch size:     4" in iterations[0]
    notes = [line for line in outputs[0].splitlines() if "accepted, no effect in megafab" in line]
    assert len(notes) == 1 and "--use-mcore-models" in notes[0] and "--tiktoken-pattern" in notes[0]
    assert os.path.exists(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
    traces = [f for f in os.listdir(tmp_path / "tb") if f.endswith(".pt.trace.json")]
    assert traces, os.listdir(tmp_path / "tb")


@pytest.mark.slow
def test_three_mistakes_under_torchrun_print_one_message_once():
    from tests.helpers.launch import torchrun

    flags = tiny_flags(hidden_size=64, num_attention_heads=8, seq_length=32) + words(
        "--micro-batch-size 1 --train-iters 2 --lr 1e-3 --mock-data --vocab-size 100") + [
        "--hiden-dropout", "0.0",  # misspelled
        "--moe-use-upcycling",  # refused
        "--tensor-model-parallel-size", "3"]  # 8 heads over 3 TP ranks
    proc = torchrun(4, flags, timeout=300)
    assert proc.returncode != 0
    ours = proc.stderr + proc.stdout
    # printed once by rank 0; torchrun's failure summary quotes it too (indented, from the error file)
    assert [line.startswith("megafab: error:") for line in ours.splitlines()].count(True) == 1, ours
    assert "traceback : megafab: error: 4 problem(s) in the configuration" in ours
    message = ours[ours.index("megafab: error:"):]
    assert "--hiden-dropout: unrecognized flag (did you mean --hidden-dropout?)" in message
    assert "--moe-use-upcycling: refused, upcycling a dense checkpoint" in message
    assert "--num-attention-heads 8 is not divisible by --tensor-model-parallel-size 3" in message
