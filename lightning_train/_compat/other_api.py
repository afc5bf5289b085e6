"""Private names of torchmetrics, lm_eval, tqdm and argparse (see the package docstring)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm

# torch and Lightning are imported inside the functions that use them, never here: the CLI's help and
# its tools (prepare, report, ...) import this module and must not pay those imports (Lightning's alone
# takes seconds; tests/test_startup.py).

# ---- torchmetrics ----------------------------------------------------------------------------------------
# Its flags for the optional packages whose metrics import them with torchmetrics itself (BERTScore, InfoLM,
# CLIPScore, CLIP-IQA: transformers; Metric.plot: matplotlib; the audio metrics' ``import scipy.signal``, a
# patch for SRMRpy: _SCIPI_); ``RequirementCache``s of ``torchmetrics.utilities.imports`` (torchmetrics
# 1.4-1.9), which skip their check once ``available`` is set.
_HEAVY_OPTIONAL_FLAGS = ("_TRANSFORMERS_AVAILABLE", "_TRANSFORMERS_GREATER_EQUAL_4_4",
                         "_TRANSFORMERS_GREATER_EQUAL_4_10", "_MATPLOTLIB_AVAILABLE", "_SCIPI_AVAILABLE")
FULL_TORCHMETRICS_ENV = "LIGHTNING_TRAIN_FULL_TORCHMETRICS"


def torchmetrics_without_heavy_extras() -> None:
    """Make the coming first import of torchmetrics (Lightning's import does it) see transformers and
    matplotlib as absent, and skip its ``import scipy.signal`` (twice a patch for one audio metric's package):
    importing those takes about 1.7 and 0.6 of the 5.5 CPU seconds of ``import lightning`` in every
    process of every run where they are installed (scipy comes with lm-eval), for metrics training does not
    use. A no-op when torchmetrics is already imported or ``LIGHTNING_TRAIN_FULL_TORCHMETRICS=1`` asks for
    those metrics. No public switch exists."""
    if "torchmetrics" in sys.modules or os.environ.get(FULL_TORCHMETRICS_ENV) == "1":
        return
    import importlib.abc
    import importlib.machinery

    import lightning_utilities.core.imports as requirements

    def exec_torchmetrics(run_module: Any, module: Any) -> None:
        # torchmetrics/__init__.py: ``if package_available("scipy"): import scipy.signal``
        available = requirements.package_available
        requirements.package_available = lambda name: name != "scipy" and available(name)
        try:
            run_module(module)
        finally:
            requirements.package_available = available

    def exec_flags(run_module: Any, module: Any) -> None:
        run_module(module)
        for flag in _HEAVY_OPTIONAL_FLAGS:
            getattr(module, flag).available = False

    class FlagsOff(importlib.abc.MetaPathFinder):
        pending = {"torchmetrics": exec_torchmetrics, "torchmetrics.utilities.imports": exec_flags}

        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name not in self.pending:
                return None
            run_instead = self.pending.pop(name)
            if not self.pending:
                sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run_module = spec.loader.exec_module
            spec.loader.exec_module = lambda module: run_instead(run_module, module)
            return spec

    sys.meta_path.insert(0, FlagsOff())


_OBJECT_STORAGE_PACKAGES = frozenset({"s3fs", "gcsfs", "adlfs"})


def object_storage_check_without_imports() -> None:
    """Lightning asks of every path it writes whether its filesystem is object storage, importing s3fs,
    gcsfs and adlfs to check (``lightning.fabric.utilities.cloud_io._is_object_storage``, Lightning
    2.5-2.6): ~0.3 CPU s in every process where the ``s3`` extra is installed, for local paths too. An
    instance of one of their filesystems exists only once its package is imported, so with none imported
    the answer is no, without importing them. Once per process (a second call finds it in place)."""
    import lightning.fabric.utilities.cloud_io as cloud_io

    check = cloud_io._is_object_storage
    if check.__module__ == __name__:
        return

    def is_object_storage(fs: Any) -> bool:
        return bool(_OBJECT_STORAGE_PACKAGES & sys.modules.keys()) and check(fs)

    cloud_io._is_object_storage = is_object_storage


# ---- lm_eval ---------------------------------------------------------------------------------------------
def _git_hash_without_stderr() -> str | None:
    """lm_eval's ``get_git_commit_hash`` with git's stderr discarded: outside a git checkout git prints
    ``fatal: not a git repository`` before lm_eval falls back to reading ``.git`` itself."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        command = ["git", "describe", "--always"]
        return subprocess.check_output(command, stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def lm_eval_console(progress: bool) -> Iterator[None]:
    """lm_eval's ``simple_evaluate`` without the ``fatal:`` line of its git probe and, with ``progress``
    False, without its console output: the progress bars of ``lm_eval.api.task`` and ``lm_eval.api.model``
    (their module-level ``tqdm``: ``build_all_requests`` has no switch), its log below errors and the
    ``datasets`` bars of a task's first load. Patches ``lm_eval.evaluator.get_git_commit_hash`` and those
    ``tqdm`` names (lm_eval 0.4.13; no public switch) for the duration, and puts them back."""
    import datasets
    import lm_eval.api.model
    import lm_eval.api.task
    import lm_eval.evaluator
    from tqdm import tqdm

    patched: list[tuple[Any, str, Any]] = [
        (lm_eval.evaluator, "get_git_commit_hash", _git_hash_without_stderr),
    ]
    if not progress:
        class QuietBar(tqdm):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "disable": True})

        patched += [(lm_eval.api.task, "tqdm", QuietBar), (lm_eval.api.model, "tqdm", QuietBar)]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]
    log = logging.getLogger("lm_eval")
    level, bars_were_on = log.level, datasets.is_progress_bar_enabled()
    try:
        for module, name, replacement in patched:
            setattr(module, name, replacement)
        if not progress:
            log.setLevel(logging.ERROR)
            datasets.disable_progress_bars()
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
        log.setLevel(level)
        if not progress and bars_were_on:
            datasets.enable_progress_bars()


# ---- tqdm and argparse ------------------------------------------------------------------------------------
def open_tqdm_bars() -> list[tqdm]:
    """Every tqdm bar not yet closed (``tqdm._instances``, tqdm 4.66-4.70; no public one)."""
    from tqdm import tqdm

    return list(getattr(tqdm, "_instances", ()))


def subcommand_actions(action: argparse.Action) -> list[argparse.Action] | None:
    """The per-subcommand actions of a subparsers action, None for any other action (``argparse.
    _SubParsersAction._get_subactions``, Python 3.10-3.13; no public one)."""
    if isinstance(action, argparse._SubParsersAction):
        return action._get_subactions()
    return None
