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
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            found.update(lazy_modules(node))  # a lazy export is a dependency too
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y, from .. import z
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base]).strip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return found


def lazy_modules(call: ast.Call) -> set[str]:
    """The modules a ``lazy_exports(globals(), {name: module, ...})`` call names."""
    return {value.value for value in call.args[1].values if isinstance(value, ast.Constant)}


def lazy_export_names(name: str) -> set[str]:
    """The names a package exports lazily (``_lazy.lazy_exports``)."""
    tree = ast.parse(MODULES[name].read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "lazy_exports"]
    return {key.value for call in calls for key in call.args[1].keys if isinstance(key, ast.Constant)}


def test_lazy_exports_name_real_objects_and_no_submodule():
    """Each lazily exported name is defined in the module named for it, and is not also the name of a
    submodule of its package (importing that submodule would set the package's attribute to it)."""
    packages = {name: lazy_export_names(name) for name in MODULES if MODULES[name].name == "__init__.py"}
    assert packages["lightning_train"] >= {"GPT", "PretrainModule"}  # the check reads the calls
    for package, names in packages.items():
        module = importlib.import_module(package)
        for export in names:
            assert f"{package}.{export}" not in MODULES, f"{package}.{export} is a submodule too"
            assert export in module.__all__ and getattr(module, export) is not None


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
