"""Lazy package exports (PEP 562): a package names what it offers and the module each name lives in,
and a module is imported on the first use of one of its names. ``import lightning_train`` and the CLI's
tools then cost what they use: ``from lightning_train import GPT`` imports torch, not Lightning (whose
import alone takes seconds); ``tests/test_startup.py`` checks which modules each tool imports."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package whose ``globals()`` is ``namespace``: ``exports``
    maps each public name to the module that defines it. A name, once imported, is set on the package,
    so later lookups are plain attribute reads."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
