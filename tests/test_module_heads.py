"""Prose and size to the code's standard: every module of megafab/ is at most MAX_LINES lines (split by
concern past that) and its module docstring, the design a reader needs first, at most MAX_HEAD lines
(history and measurements belong in benchmarks/README.md and commit bodies)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megafab"
MAX_LINES = 450
MAX_HEAD = 20

FILES = sorted(PACKAGE.rglob("*.py"))


def head_lines(tree: ast.Module) -> int:
    """Lines the module docstring spans, quotes included (0 without one)."""
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def test_every_module_is_at_most_450_lines():
    assert len(FILES) > 100
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in FILES
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"over {MAX_LINES} lines (split by concern):\n" + "\n".join(long)


def test_every_module_head_is_at_most_20_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in FILES
            if (n := head_lines(ast.parse(p.read_text(encoding="utf-8")))) > MAX_HEAD]
    assert not long, f"module docstrings over {MAX_HEAD} lines:\n" + "\n".join(long)


def test_the_head_is_measured_from_the_docstring_quotes():
    assert head_lines(ast.parse('"""one line."""\nx = 1\n')) == 1
    assert head_lines(ast.parse('"""first\n\nlast\n"""\n')) == 4
    assert head_lines(ast.parse("x = 1\n")) == 0
    assert head_lines(ast.parse("")) == 0
