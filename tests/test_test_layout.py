"""tests/helpers/ is the only helper home: no module under tests/ imports a test module (only
tests.helpers.* and tests.conftest), and nothing the package ships or runs on its own (megafab/,
benchmarks/, tools/, the repo's scripts) imports tests/ at all."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
ALLOWED = ("tests.helpers", "tests.conftest")


def _module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in `source` (relative ones resolved from `module`; `from a
    import b` counts as a.b, since b may be a module), and of import_module / __import__ calls
    with a constant name."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value))
    return out


def _is_tests(name: str) -> bool:
    return name == "tests" or name.startswith("tests.")


def _allowed(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in ALLOWED)


def imports_of_test_modules(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of tests/ modules that are neither helpers nor the conftest."""
    return [f"{module}:{line} imports {name}" for line, name in imported_modules(source, module, is_package)
            if _is_tests(name) and not _allowed(name)]


def _py_files(*dirs: str):
    for d in dirs:
        yield from sorted((ROOT / d).rglob("*.py"))


def test_no_test_module_imports_another():
    found = []
    for path in _py_files("tests"):
        found += imports_of_test_modules(path.read_text(), _module_name(path),
                                                   path.name == "__init__.py")
    assert not found, "import shared code from tests/helpers/ instead:\n" + "\n".join(found)


def test_nothing_outside_tests_imports_them():
    paths = list(_py_files("megafab", "benchmarks", "tools")) + sorted(ROOT.glob("*.py"))
    assert len(paths) > 50
    found = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in paths
             for line, name in imported_modules(path.read_text(), _module_name(path),
                                                path.name == "__init__.py")
             if _is_tests(name)]
    assert not found, "\n".join(found)


def test_the_scan_finds_each_kind_of_import_between_test_modules():
    source = """
import tests.model.test_gpt_tp_parity
from tests.training import launch
from tests.checkpoint.test_moe_resume import MOE
from .test_hf_roundtrip import VOCAB
from . import test_generate
import importlib
importlib.import_module("tests.training.test_faults")
from tests.helpers.tiny import tiny_config
from tests.helpers import driver
from tests import helpers, conftest
import tests.helpers.flags
"""
    found = imports_of_test_modules(source, "tests.convert.test_x")
    assert [f.split(" imports ")[1] for f in found] == [
        "tests.model.test_gpt_tp_parity", "tests.training.launch", "tests.checkpoint.test_moe_resume.MOE",
        "tests.convert.test_hf_roundtrip.VOCAB", "tests.convert.test_generate", "tests.training.test_faults"]
