"""Every script in benchmarks/ explains itself in `--help`: what it measures (its description), each
option's help with its default, and how long it takes. Read from each script's parser calls (importing
a benchmark loads torch, Prefect or lm-eval: seconds each); `tests/test_benchmarks_smoke.py` runs
load.py's `--help` for real."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == name]


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def text_of(node: ast.expr | None, doc: str) -> str:
    """A help or description argument as the reader sees it: a string, an f-string's literal parts, __doc__."""
    if node is None:
        return ""
    if isinstance(node, ast.Name) and node.id == "__doc__":
        return doc
    return " ".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def test_every_benchmark_is_listed():
    assert len(BENCHMARKS) >= 14 and any(p.name == "deploy.py" for p in BENCHMARKS)


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_help_says_what_it_measures_each_default_and_how_long(script: Path):
    tree = ast.parse(script.read_text())
    doc = ast.get_docstring(tree) or ""
    parsers = calls(tree, "ArgumentParser")
    assert len(parsers) == 1, f"{script.name}: one argparse parser"
    description = text_of(keyword(parsers[0], "description"), doc)
    assert len(description.split()) >= 30, f"{script.name}: its description says what it measures"
    epilog = text_of(keyword(parsers[0], "epilog"), doc)
    assert "Expected duration: " in epilog, f"{script.name}: its help ends with how long it takes"
    for option in calls(tree, "add_argument"):
        flag = option.args[0].value
        help_text = " ".join(text_of(keyword(option, "help"), doc).split())
        assert help_text, f"{script.name} {flag}: no help"
        action = keyword(option, "action")
        takes_value = not (isinstance(action, ast.Constant) and action.value in ("store_true", "store_false"))
        required = isinstance(keyword(option, "required"), ast.Constant) and keyword(option, "required").value
        if takes_value and not required and flag.startswith("-"):
            assert "default" in help_text, f"{script.name} {flag}: its help does not say its default"
