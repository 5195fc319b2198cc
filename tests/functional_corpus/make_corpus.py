"""Writes corpus.json: the command line of every `gpt`, `moe` and `mixtral` case of Megatron-LM's
functional tests (tests/functional_tests/test_cases/*/*/model_config.yaml at COMMIT), as Megatron's
own runner (tests/functional_tests/shell_test_utils/_run_training.sh) hands it to the training script,
with the world size the case runs at. Not run by the test suite (CI has no Megatron-LM mirror);
tests/test_megatron_functional_tests.py reads the committed corpus. To regenerate (seconds):

    .venv/bin/python -m tests.functional_corpus.make_corpus [--mirror GIT_DIR]

MODEL_ARGS -> words as the runner's yq and bash make them (tests/helpers/megatron_runner.py). The
runner's paths -> local stand-ins named by the flag ({data}, {vocab}, {merges}, {spm}, {tiktoken},
{hf_tokenizer}, {load}, {save}, {tb}, {cache}, {out}, {file}: tests/helpers/functional_corpus.py makes
them), a Hugging Face Hub tokenizer name too (nothing downloads). World: the first recipe naming the
case (tests/test_utils/recipes/, H100's first): its nodes x the GPUS_PER_NODE its script exports, else
the runner's 8; a case in no recipe (the release ones) runs on one node of 8, or on the smallest world
its layout fits (TP x PP x CP and ETP x EP x PP) where 8 is not one. Flags only another entry script
defines (the recipe's TRAINING_SCRIPT_PATH: inference) are kept apart from pretrain_gpt.py's command
line. The first run's MODEL_ARGS only (a checkpoint-resume case's second run repeats them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess

import yaml

from tests.helpers.megatron_runner import model_args_words, yaml_as_text

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
MODELS = ("gpt", "moe", "mixtral")
CASES = "tests/functional_tests/test_cases"
RECIPES = "tests/test_utils/recipes"
HEAD_CENSUS = os.path.join(ROOT, "tests", "config", "fixtures", "megatron_flags_head.json")
# pretrain_gpt.py's parser beyond add_megatron_arguments: its extra_args_provider (with ModelOpt)
PRETRAIN_EXTRA_ARGS = "megatron/post_training/arguments.py"
RUNNER_GPUS = 8  # _run_training.sh's GPUS_PER_NODE unless the recipe's script or the case sets it

# a placeholder path -> the stand-in, by the flag that names it (tokenizer files by --tokenizer-type)
BY_FLAG = {"--data-path": "{data}", "--vocab-file": "{vocab}", "--merge-file": "{merges}", "--load": "{load}",
           "--pretrained-checkpoint": "{load}", "--save": "{save}", "--tensorboard-dir": "{tb}",
           "--data-cache-path": "{cache}", "--wandb-save-dir": "{tb}", "--output-path": "{out}",
           "--export-kd-teacher-load": "{load}", "--export-kd-cfg": "{file}", "--prompt-file": "{file}",
           "--wandb-exp-name": "functional-corpus", "--seed": "1"}
TOKENIZER_MODEL = {"Llama2Tokenizer": "{spm}", "GPTSentencePieceTokenizer": "{spm}",
                   "SentencePieceTokenizer": "{spm}", "TikTokenizer": "{tiktoken}",
                   "HuggingFaceTokenizer": "{hf_tokenizer}"}


def git(mirror: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={mirror}", *args], capture_output=True, text=True,
                          check=True).stdout


def placeholders_replaced(words: list[str], case: str) -> list[str]:
    tokenizer = words[words.index("--tokenizer-type") + 1] if "--tokenizer-type" in words else None
    out = []
    for i, word in enumerate(words):
        flag = words[i - 1] if i else None
        hub_name = re.fullmatch(r"[\w.-]+/[\w.-]+", word)
        if flag == "--tokenizer-model" and tokenizer == "HuggingFaceTokenizer" and hub_name:
            word = "{hf_tokenizer}"
        if "$" in word:
            stand_in = TOKENIZER_MODEL.get(tokenizer) if flag == "--tokenizer-model" else BY_FLAG.get(flag)
            assert stand_in is not None, (case, flag, word)
            word = stand_in
        assert not any(c in word for c in "$`\\\"'"), (case, word)
        out.append(word)
    return out


def recipes(mirror: str) -> dict[tuple[str, str], tuple[int, str, str]]:
    """(model, case) -> (nodes, GPUs per node, recipe, entry script) of the first recipe naming it,
    H100's first: the GPUS_PER_NODE its script exports (the recipe's `gpus` sizes the allocation only)."""
    files = [f for f in git(mirror, "ls-tree", "-r", "--name-only", COMMIT, RECIPES).split()
             if f.endswith(".yaml")]
    files.sort(key=lambda f: (not f.startswith(f"{RECIPES}/h100/"), f))
    found = {}
    for path in files:
        recipe = yaml.safe_load(git(mirror, "show", f"{COMMIT}:{path}"))
        spec = recipe.get("spec") or {}
        if "nodes" not in spec:
            continue  # a build or clean-up recipe: no test case
        per_node = re.search(r"(?:GPUS_PER_NODE=|--nproc_per_node )(\{gpus\}|\d+)", spec.get("script", ""))
        per_node = per_node and (spec["gpus"] if per_node.group(1) == "{gpus}" else int(per_node.group(1)))
        nodes, per_node, script = spec["nodes"], per_node or RUNNER_GPUS, entry_script(spec.get("script", ""))
        for product in recipe.get("products") or []:
            for case in product.get("test_case", []):
                found.setdefault((spec.get("model"), case), (nodes, per_node, path[len(RECIPES) + 1:],
                                                              script))
    return found


def entry_script(text: str) -> str | None:
    """The script a recipe runs: its TRAINING_SCRIPT_PATH, else the .py it hands torch.distributed.run."""
    given = re.search(r'TRAINING_SCRIPT_PATH=([^"\s]+)', text) or \
        re.search(r"torch\.distributed\.run.*?\s(\S+\.py)\s", text, re.S)
    return given.group(1) if given else None


def _value(words: list[str], flag: str, default: int) -> int:
    return int(words[words.index(flag) + 1]) if flag in words else default


def fitting_world(words: list[str]) -> int:
    """The runner's 8, or the smallest world the layout's model and expert grids both divide."""
    tp = _value(words, "--tensor-model-parallel-size", 1)
    pp = _value(words, "--pipeline-model-parallel-size", 1)
    cp = _value(words, "--context-parallel-size", 1)
    etp = _value(words, "--expert-tensor-parallel-size", tp)
    grids = math.lcm(tp * pp * cp, etp * _value(words, "--expert-model-parallel-size", 1) * pp)
    return RUNNER_GPUS if RUNNER_GPUS % grids == 0 else grids


def pretrain_flags(mirror: str) -> set[str]:
    """The flags Megatron-LM's pretrain_gpt.py parses at COMMIT: its parser's census, its extra args."""
    with open(HEAD_CENSUS) as f:
        census = json.load(f)
    assert census["commit"] == COMMIT, census["commit"]
    source = git(mirror, "show", f"{COMMIT}:{PRETRAIN_EXTRA_ARGS}")
    extra = re.findall(r"""add_argument\(\s*['"](--[\w-]+)['"]""", source)
    return set(census["flags"]) | set(extra)


def defined_in(mirror: str, flag: str, script: str) -> str:
    """The Megatron-LM file that declares `flag` for `script`, for the corpus's record: the script
    itself, else megatron/ (its inference or RL argument providers), else the first other file."""
    hits = git(mirror, "grep", "-l", "-E", rf"""['"]{re.escape(flag)}['"]""", COMMIT, "--", "*.py").split()
    hits = [h.split(":", 1)[1] for h in hits if not h.split(":", 1)[1].startswith("tests/")]
    assert hits, f"{flag}: declared nowhere in Megatron-LM {COMMIT}"
    return min(hits, key=lambda h: (h != script, not h.startswith("megatron/"), h))


def corpus(mirror: str) -> list[dict]:
    known, runs, declared = pretrain_flags(mirror), recipes(mirror), {}
    paths = git(mirror, "ls-tree", "-r", "--name-only", COMMIT, CASES).split()
    out = []
    for path in sorted(p for p in paths if p.endswith("/model_config.yaml")):
        model, case = path.split("/")[-3:-1]
        if model not in MODELS:
            continue
        config = yaml_as_text(git(mirror, "show", f"{COMMIT}:{path}"))
        words = placeholders_replaced(model_args_words(config.get("MODEL_ARGS")), case)
        nodes, per_node, recipe, script = runs.get((model, case), (None, None, None, "pretrain_gpt.py"))
        # run_ci_test.sh exports the case's own GPUS_PER_NODE for its MODEL_ARGS run
        own = (config.get("MODEL_ENV_VARS") or {}).get("MODEL_ARGS") or {}
        per_node = own.get("GPUS_PER_NODE", per_node)
        world = nodes * int(per_node) if recipe else fitting_world(words)
        argv, elsewhere = words, []
        if script != "pretrain_gpt.py":  # its own parser's flags, not pretrain_gpt.py's
            argv, i = [], 0
            while i < len(words):
                end = next((j for j in range(i + 1, len(words)) if words[j].startswith("--")), len(words))
                if words[i] in known:
                    argv += words[i:end]
                else:
                    if (words[i], script) not in declared:
                        declared[words[i], script] = defined_in(mirror, words[i], script)
                    elsewhere.append(words[i])
                i = end
        out.append({"case": f"{model}/{case}", "test_type": config.get("TEST_TYPE"),
                    "mode": config.get("MODE"), "script": script, "world": world, "recipe": recipe,
                    "argv": shlex.join(argv),
                    "script_flags": {f: declared[f, script] for f in elsewhere}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mirror", default=MIRROR, help="Megatron-LM's git directory (bare is fine)")
    mirror = parser.parse_args().mirror
    cases = corpus(mirror)
    rows = ",\n".join(json.dumps(c, sort_keys=True) for c in cases)
    out = os.path.join(HERE, "corpus.json")
    with open(out, "w") as f:  # one case a line
        f.write(f'{{"megatron_lm": "{COMMIT}",\n"cases": [\n{rows}\n]}}\n')
    print(f"{len(cases)} cases -> {out}")


if __name__ == "__main__":
    main()
