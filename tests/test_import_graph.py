"""The package's import graph: every module imports, no cycle anywhere, and models/ stays plain PyTorch."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_train"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """Every module ``name`` imports, at the top or inside a function (a lazy import is a dependency too)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y, from .. import z
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base]).strip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return found


def package_graph() -> dict[str, set[str]]:
    return {name: {m for m in imports_of(name) if m in MODULES and m != name} for name in MODULES}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as the chain of modules), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for child in sorted(graph[node]):
            if cycle := visit(child):
                return cycle
        path.pop()
        done.add(node)
        return None

    return next((cycle for name in sorted(graph) if (cycle := visit(name))), None)


def test_no_import_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check can fail
    assert find_cycle(package_graph()) is None


def test_models_import_only_plain_pytorch():
    """models/ is plain PyTorch: torch and its libraries, the standard library, models/ and errors.py."""
    allowed = {"torch", "torchao", "safetensors", "peft", "__future__", *sys.stdlib_module_names}
    ours = ("lightning_train.models", "lightning_train.errors")
    offending = {
        name: sorted(m for m in imports_of(name) if not (m.split(".")[0] in allowed or m.startswith(ours)))
        for name in MODULES
        if name.startswith("lightning_train.models")
    }
    assert not any(offending.values()), offending
