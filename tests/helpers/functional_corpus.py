"""Megatron-LM's functional-test corpus (tests/functional_corpus/corpus.json, written by its
make_corpus.py) through `pretrain_gpt.py --dry-run` in this process: each case's command line with
local stand-in files, at its world size, through what megafab.cli.pretrain.main does for a dry run
(config_from_args with the entry point's machine checks and start-up probes, then the plan), and the
table docs/megatron_functional_tests.md holds. Each case also runs without the machine checks, which
tells what this machine lacks (Transformer Engine, a CUDA GPU, a package) from what megafab refuses.

    .venv/bin/python -m tests.helpers.functional_corpus     # rewrites the docs table
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import itertools
import json
import os
import re
import shlex
import shutil
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "functional_corpus", "corpus.json")
TABLE = os.path.join(ROOT, "docs", "megatron_functional_tests.md")
FIXTURES = os.path.join(ROOT, "tests", "data", "fixtures")
TIKTOKEN_RANKS = 2**17 - 1000  # Megatron's TikTokenizer: --vocab-size 131072 less 1000 special tokens
# HEAD flags other engineers are building now (issue 39), "unrecognized" until each lands
BEING_BUILT: set[str] = set()
UNRECOGNIZED = ": unrecognized flag"


def load_corpus() -> tuple[str, list[dict]]:
    with open(CORPUS) as f:
        corpus = json.load(f)
    return corpus["megatron_lm"], corpus["cases"]


def _tiktoken_vocabulary(path: str) -> None:
    """A Megatron tiktoken vocabulary of Megatron's default size: the 256 bytes, then byte pairs and
    triples as the other ranks (their text is never tokenized here)."""
    tokens = itertools.chain((bytes([i]) for i in range(256)), itertools.product(range(256), repeat=2),
                             itertools.product(range(256), repeat=3))
    with open(path, "w") as f:  # written as text: json.dump of 130,072 entries takes seconds
        f.write("[" + ",".join(f'{{"rank": {rank}, "token_bytes": "{base64.b64encode(bytes(t)).decode()}", '
                               f'"token_str": ""}}' for rank, t in zip(range(TIKTOKEN_RANKS), tokens)) + "]")


def stand_ins(root: str) -> dict[str, str]:
    """The local files behind the corpus's placeholders: a tiny Megatron dataset, the tiny
    tokenizers of tests/data/fixtures, a tiktoken vocabulary, empty directories and an empty file."""
    # deferred: the table's reader needs no torch
    from megafab.data.indexed_dataset import IndexedDatasetWriter

    writer = IndexedDatasetWriter(os.path.join(root, "corpus_text_document.bin"))
    writer.add_document([1, 2, 3, 0])
    writer.finalize(os.path.join(root, "corpus_text_document.idx"))
    paths = {"data": os.path.join(root, "corpus_text_document"), "file": os.path.join(root, "file.txt"),
             "tiktoken": os.path.join(root, "tiktoken.json"), "spm": os.path.join(FIXTURES, "sp_tiny.model"),
             "vocab": os.path.join(FIXTURES, "gpt2_tiny", "vocab.json"),
             "merges": os.path.join(FIXTURES, "gpt2_tiny", "merges.txt"),
             "hf_tokenizer": os.path.join(FIXTURES, "hf_tiny")}
    _tiktoken_vocabulary(paths["tiktoken"])
    open(paths["file"], "w").close()
    for name in ("load", "save", "tb", "cache", "out"):
        paths[name] = os.path.join(root, name)
        os.makedirs(paths[name])
    return paths


def command_line(case: dict, paths: dict[str, str]) -> list[str]:
    return [word.format(**paths) if "{" in word else word for word in shlex.split(case["argv"])]


@dataclasses.dataclass
class Outcome:
    status: str  # "runs" (the plan printed), "refused" (one message) or "traceback" (anything else)
    problems: list[str]


def dry_run(argv: list[str], world: int, with_machine: bool = True) -> Outcome:
    """pretrain_gpt.py ARGV --dry-run at world size `world`, as megafab.cli.pretrain.main runs it;
    `with_machine`: with its checks of this machine (TE, CUDA, attention kernels, packages)."""
    # deferred: torch and the planner load only when a case runs
    from megafab.arguments import config_from_args
    from megafab.cli.pretrain import machine_checks
    from megafab.config import ConfigError
    from megafab.errors import MegafabError
    from megafab.plan.planner import format_plan, plan
    from megafab.plan.report import dry_run_prediction

    try:
        cfg = config_from_args([*argv, "--dry-run"], world_size=world,
                               checks=machine_checks() if with_machine else (), start_up=True)
        cfg.start_up_notes()
        stages = plan(cfg)
        format_plan(cfg, stages, step_time=dry_run_prediction(cfg, stages))
        return Outcome("runs", [])
    except ConfigError as error:
        return Outcome("refused", error.problems)
    except MegafabError as error:
        return Outcome("refused", [str(error)])
    except Exception as error:  # noqa: BLE001 -- a traceback, which the test counts
        return Outcome("traceback", [f"{type(error).__name__}: {error}"])


@dataclasses.dataclass
class Result:
    case: dict
    here: Outcome  # on this machine, as pretrain_gpt.py --dry-run
    rules: Outcome  # the same without the machine checks: megafab's rules and probes alone

    @property
    def machine_problems(self) -> list[str]:
        return [p for p in self.here.problems if p not in self.rules.problems]


def run_corpus(cases: list[dict]) -> list[Result]:
    """Every case with a command line (a case without MODEL_ARGS has nothing to run), the stand-ins'
    directory written as {stand-ins} in the problems."""
    root = tempfile.mkdtemp(prefix="functional_corpus_")
    try:
        paths = stand_ins(root)
        results = []
        for case in cases:
            if case["argv"]:
                argv, world = command_line(case, paths), case["world"]
                results.append(Result(case, dry_run(argv, world), dry_run(argv, world, with_machine=False)))
        for outcome in (o for r in results for o in (r.here, r.rules)):
            outcome.problems = [p.replace(root, "{stand-ins}") for p in outcome.problems]
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def reason(problem: str) -> str:
    """A problem as its reason, the same for every case: a refused flag's why (its flags listed
    apart), a rule's text with its numbers as N."""
    refused = re.match(r"(--[\w-]+): refused, (.*?)(; remove it \(megafab never ignores a flag\))?$", problem)
    if refused:
        return f"refused: {refused.group(2)}"
    return re.sub(r"(?<![\w.-])\d+(\.\d+)?(?![\w.])", "N", problem)


# Problems that features other engineers are building now take away (issue 39): a case refused only
# for these runs once they land, and the table is regenerated then.
BEING_BUILT_PROBLEMS = {
    "--step-batch-size-schedule (issue 39, item 2)": r"^--step-batch-size-schedule\b",
    "--dataloader-inter-document-masking (item 3)": r"^--dataloader-inter-document-masking\b",
    "--megatron-fsdp-*-dtype (item 3)": r"^--megatron-fsdp-[\w-]+-dtype\b",
    "--eval-micro/global-batch-size (item 3)": r"^--eval-(micro|global)-batch-size\b",
    "Transformer Engine with context parallelism (item 5)": r"megafab's own CP attention, not Transformer",
}


def being_built(problem: str) -> str | None:
    return next((what for what, rx in BEING_BUILT_PROBLEMS.items() if re.search(rx, problem)), None)


def machine() -> str:
    """This machine's facts that the machine checks read."""
    # deferred: torch only for the table
    import importlib.util

    import torch

    from megafab.model.te import te_available

    have = {"CUDA GPU": torch.cuda.is_available(), "transformer_engine": te_available(),
            "wandb": importlib.util.find_spec("wandb") is not None}
    return ", ".join(f"{what} {'yes' if present else 'no'}" for what, present in have.items())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _flag(problem: str) -> str | None:
    """The flag a refusal or an unrecognized flag names."""
    named = re.match(r"(--[\w-]+): (refused, |unrecognized flag)", problem)
    return named.group(1) if named else None


@dataclasses.dataclass
class Reason:
    cases: set = dataclasses.field(default_factory=set)
    flags: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    machine: bool = False
    alone: int = 0  # the cases megafab's rules refuse for this reason only


def reasons(results: list[Result]) -> dict[str, Reason]:
    """Each reason -> the cases it refuses (here or by the rules), its flags, whether a machine check."""
    out = collections.defaultdict(Reason)
    for r in results:
        for p in set(r.here.problems) | set(r.rules.problems):
            entry = out[reason(p)]
            entry.cases.add(r.case["case"])
            entry.machine = entry.machine or p in r.machine_problems
            if _flag(p):
                entry.flags[_flag(p)] += 1
        if len({reason(p) for p in r.rules.problems}) == 1:
            out[reason(r.rules.problems[0])].alone += 1
    return dict(sorted(out.items(), key=lambda kv: (kv[1].machine, -len(kv[1].cases), kv[0])))


def reason_ids(found: dict[str, Reason]) -> dict[str, str]:
    """R1, R2, ... for megafab's reasons, M1, M2, ... for this machine's (after them): the rules' ids
    are the same on every machine."""
    counters = collections.Counter()
    ids = {}
    for text, r in found.items():
        kind = "M" if r.machine else "R"
        counters[kind] += 1
        ids[text] = f"{kind}{counters[kind]}"
    return ids


HEADER = """# Megatron-LM's functional tests through `pretrain_gpt.py --dry-run`

Megatron-LM {commit}'s functional-test cases of the `gpt`, `moe` and `mixtral` models
(`tests/functional_tests/test_cases/*/*/model_config.yaml`), each as the command line Megatron's runner
hands its training script (`tests/functional_corpus/make_corpus.py` wrote them into
`tests/functional_corpus/corpus.json` and says how), through megafab's `pretrain_gpt.py --dry-run` at
the world size its recipe runs it at, with local stand-ins for its data, tokenizer and checkpoint paths.
"Here" is this machine, with the entry point's checks of it; "rules" is the same without them: megafab's
own rules and start-up probes, what a GPU with Transformer Engine would still refuse. Written by
`.venv/bin/python -m tests.helpers.functional_corpus`; tests/test_megatron_functional_tests.py checks
that it is what megafab does now.

Machine: {machine}.
"""


def _counts(cases: list[dict], results: list[Result]) -> list[str]:
    here = collections.Counter(r.here.status for r in results)
    rules = collections.Counter(r.rules.status for r in results)
    unrecognized = sorted({_flag(p) for r in results for p in r.here.problems if UNRECOGNIZED in p})
    with_unrecognized = sum(any(UNRECOGNIZED in p for p in r.here.problems) for r in results)
    scripts = collections.Counter(c["script"] for c in cases if c["argv"])
    del scripts["pretrain_gpt.py"]
    script_flags = collections.Counter(f for c in cases for f in c["script_flags"])
    return [
        "## Counts", "", "| | cases |", "|---|---:|",
        f"| `model_config.yaml` files | {len(cases)} |",
        f"| with no MODEL_ARGS (nothing to run) | {len(cases) - len(results)} |",
        f"| through `pretrain_gpt.py --dry-run` | {len(results)} |",
        f"| here: runs (the plan printed) | {here['runs']} |",
        f"| here: refused (one message, exit 2) | {here['refused']} |",
        f"| here: traceback | {here['traceback']} |",
        f"| here: with an unrecognized flag | {with_unrecognized} |",
        f"| rules: runs (refused here for this machine only) | {rules['runs']} |",
        f"| rules: refused | {rules['refused']} |",
        f"| rules: refused only for what issue 39 is building now | {sum(map(only_being_built, results))} |",
        "",
        f"Unrecognized flags: {', '.join(f'`{f}`' for f in unrecognized) or 'none'}.",
        "",
        "Megatron runs some cases with another entry script ("
        + ", ".join(f"`{s}` {n}" for s, n in sorted(scripts.items()))
        + "); the flags only that script's parser defines are left out of their `pretrain_gpt.py` command "
        "line (the corpus keeps them, with the file that declares each): "
        + ", ".join(f"`{f}` ({n})" for f, n in sorted(script_flags.items())) + ".", ""]


def only_being_built(result: Result) -> bool:
    return bool(result.rules.problems) and all(being_built(p) for p in result.rules.problems)


def _reason_table(found: dict[str, Reason], ids: dict[str, str]) -> list[str]:
    lines = ["## Reasons", "",
             "Each reason with the cases it refuses (the numbers in a rule's text written N), the cases",
             "megafab's rules refuse for it alone, and a refusal's flags with their cases. R: megafab's",
             "reasons; M: this machine's checks.", "",
             "| id | reason | cases | alone | flags (cases) |", "|---|---|---:|---:|---|"]
    for text, r in found.items():
        flags = ", ".join(f"`{f}` ({n})" for f, n in sorted(r.flags.items(), key=lambda x: (-x[1], x[0])))
        lines.append(f"| {ids[text]} | {_cell(text)} | {len(r.cases)} | {r.alone} | {flags} |")
    return lines + [""]


def _case_table(cases: list[dict], results: list[Result], ids: dict[str, str]) -> list[str]:
    def verdict(outcome: Outcome) -> str:
        found = sorted({ids[reason(p)] for p in outcome.problems}, key=lambda i: (i[0] == "M", int(i[1:])))
        return outcome.status + (": " + " ".join(found) if found else "")

    lines = ["## Cases", "", "| case | world | Megatron's script | here | rules |", "|---|---:|---|---|---|"]
    by_case = {r.case["case"]: r for r in results}
    for c in cases:
        r = by_case.get(c["case"])
        if r is None:
            lines.append(f"| {c['case']} | {c['world']} | `{c['script']}` | no MODEL_ARGS | |")
            continue
        built = sorted({being_built(p) for p in r.rules.problems} - {None})
        note = f" (only what issue 39 is building: {'; '.join(built)})" if only_being_built(r) else ""
        lines.append(f"| {c['case']} | {c['world']} | `{c['script']}` | {verdict(r.here)} | "
                     f"{verdict(r.rules)}{note} |")
    return lines


def render(megatron_lm: str, cases: list[dict], results: list[Result], here: str) -> str:
    """docs/megatron_functional_tests.md; `here`: machine()."""
    found = reasons(results)
    ids = reason_ids(found)
    lines = [HEADER.format(commit=megatron_lm[:10], machine=here), *_counts(cases, results),
             *_reason_table(found, ids), *_case_table(cases, results, ids)]
    return "\n".join(lines) + "\n"


def main() -> None:
    megatron_lm, cases = load_corpus()
    text = render(megatron_lm, cases, run_corpus(cases), machine())
    os.makedirs(os.path.dirname(TABLE), exist_ok=True)
    with open(TABLE, "w") as f:
        f.write(text)
    print(f"{len(cases)} cases -> {TABLE}")


if __name__ == "__main__":
    main()
