"""The worker core (runner, worker, forward context, profile), the engine and the scheduler
name no model family and no family's cache spec: they reach every kind of cache layer through
``workers.kinds`` and every model through ``workers.models.registry``. Identifiers and string
literals are checked; docstrings and comments may explain what the kinds are."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvcore

ROOT = Path(__file__).resolve().parents[2]
CORE = [
    "workers/runner.py",
    "workers/worker.py",
    "workers/forward_context.py",
    "workers/profiling.py",
    "workers/group_step.py",
    "cluster/engine.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cluster/scheduler").glob("*.py")),
]
# Words that belong to one family or one kind of cache layer.
FAMILY_WORDS = (
    "mamba", "mla", "latent", "deepseek", "nemotron", "llama", "qwen", "mistral", "ssm",
    "ssd", "conv1d", "sliding", "hybrid", "moe", "expert",
)  # fmt: skip
# Every cache spec kvcore defines but the base every kind shares.
FAMILY_SPECS = {name for name in kvcore.__all__ if name.endswith("Spec") and name != "KVCacheSpec"}


def names_and_strings(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of every identifier and string literal, docstrings left out."""
    docstrings = {
        id(body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.lineno, node.name))
        elif isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
        elif isinstance(node, ast.alias):
            found.append((node.lineno, node.name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None):
            found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            found.append((node.lineno, node.value))
    return found


@pytest.mark.parametrize("path", CORE)
def test_the_core_names_no_family_and_no_family_spec(path):
    tree = ast.parse((ROOT / path).read_text())
    offenders = [
        f"{path}:{line}: {text!r}"
        for line, text in names_and_strings(tree)
        if any(word in text.lower() for word in FAMILY_WORDS)
        or any(spec in text for spec in FAMILY_SPECS)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_what_it_looks_for():
    """The scan finds a family's name in code and in a string, and not in a docstring."""
    source = '"""Mamba is fine here."""\nx = MambaSpec\nname = "deepseek"\n'
    texts = [text for _, text in names_and_strings(ast.parse(source))]
    assert "MambaSpec" in texts and "deepseek" in texts
    assert not any("Mamba is fine" in text for text in texts)
